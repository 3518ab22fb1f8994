package host

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/cache"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// ClaimCache watches the host namespace's PVCs so that a first publish of a
// volume need not read its claim from the API server only to learn that it
// is there and bound, and so that the hotplug queue can write and release an
// exclusive attach's reservation without reading the claim first. It is a
// shortcut, never a fence: a reservation written from a cached claim carries
// its resourceVersion, so the API server takes it only if the claim is still
// as cached (a stale copy costs a conflict and a read), and the queue reads
// whatever it would decide without writing (pkg/hotplug, ClaimCache). So the
// whole claim is kept, as an update writes it back, but for managedFields,
// which an update that omits them leaves as they are (Kubernetes' field
// manager keeps them for clients unaware of them), and the status but its
// phase, which an update of the claim never changes (the API server's claim
// strategy keeps the stored status; it has its own subresource).
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
	_ = inf.SetTransform(trimClaim)
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

// CachedClaim returns the claim as the cache holds it, for the hotplug
// queue's reservation writes; false when the cache cannot say.
func (cc *ClaimCache) CachedClaim(name string) (hotplug.HostClaim, bool) {
	if !cc.inf.HasSynced() {
		return hotplug.HostClaim{}, false
	}
	obj, ok, err := cc.inf.GetStore().GetByKey(cc.namespace + "/" + name)
	if err != nil || !ok {
		return hotplug.HostClaim{}, false
	}
	pvc, ok := obj.(*corev1.PersistentVolumeClaim)
	if !ok {
		return hotplug.HostClaim{}, false
	}
	cl := hostClaim(pvc)
	cl.Cached = true
	return cl, true
}

// trimClaim drops what nothing here reads and an update need not carry:
// managedFields and the status but its phase.
func trimClaim(obj any) (any, error) {
	if pvc, ok := obj.(*corev1.PersistentVolumeClaim); ok {
		pvc.ManagedFields = nil
		pvc.Status = corev1.PersistentVolumeClaimStatus{Phase: pvc.Status.Phase}
	}
	return obj, nil
}
