package host

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/cache"
)

// ClaimCache watches the host namespace's PVCs so that a first publish of a
// volume need not read its claim from the API server only to learn that it
// is there and bound: that read was one host request of about three per
// operation under churn. It is a shortcut for the answer, never a fence: the
// hotplug queue still reads the claim live right before it writes the VM, so
// a claim deleted after the cache saw it is caught there. Only what the
// shortcut needs is kept (name, phase, deletion), so a namespace that also
// holds many VM disks costs little memory.
type ClaimCache struct {
	namespace string
	inf       cache.SharedIndexInformer
}

// ClaimCache builds the cache; Run fills it.
func (c *Client) ClaimCache(resync time.Duration) *ClaimCache {
	pvcs := c.Kube.CoreV1().PersistentVolumeClaims(c.Namespace)
	inf := cache.NewSharedIndexInformer(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return pvcs.List(ctx, o)
		},
		WatchFuncWithContext: pvcs.Watch,
	}, &corev1.PersistentVolumeClaim{}, resync, cache.Indexers{})
	_ = inf.SetTransform(claimSummary)
	return &ClaimCache{namespace: c.Namespace, inf: inf}
}

// Run keeps the cache until ctx ends.
func (cc *ClaimCache) Run(ctx context.Context) { cc.inf.RunWithContext(ctx) }

// ShowsBound reports whether the cache holds the claim, Bound and not being
// deleted. False says nothing (not synced yet, not seen yet, deleted, not
// bound): the caller reads the API server then.
func (cc *ClaimCache) ShowsBound(name string) bool {
	if !cc.inf.HasSynced() {
		return false
	}
	obj, ok, err := cc.inf.GetStore().GetByKey(cc.namespace + "/" + name)
	if err != nil || !ok {
		return false
	}
	pvc, ok := obj.(*corev1.PersistentVolumeClaim)
	return ok && pvc.DeletionTimestamp == nil && pvc.Status.Phase == corev1.ClaimBound
}

// claimSummary keeps what ShowsBound reads (and the store's key).
func claimSummary(obj any) (any, error) {
	pvc, ok := obj.(*corev1.PersistentVolumeClaim)
	if !ok {
		return obj, nil
	}
	return &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: pvc.Name, Namespace: pvc.Namespace, ResourceVersion: pvc.ResourceVersion,
			UID: pvc.UID, DeletionTimestamp: pvc.DeletionTimestamp},
		Status: corev1.PersistentVolumeClaimStatus{Phase: pvc.Status.Phase},
	}, nil
}
