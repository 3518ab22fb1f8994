package driver

import (
	"context"
	"errors"
	"fmt"
	"sort"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// GuestClaims watches the guest cluster's pods to tell which still use the
// claim of a ReadWriteMany volume (ClaimUsers). It runs on every controller
// replica, since whichever replica the attacher reaches answers the
// unpublish; it is started only when RWX volumes are served.
type GuestClaims struct {
	client  kubernetes.Interface
	driver  string
	factory informers.SharedInformerFactory
	pods    cache.SharedIndexInformer
	started chan struct{}
}

const indexPodClaim = "claim"

// NewGuestClaims builds the pod cache; Start runs it.
func NewGuestClaims(client kubernetes.Interface, driverName string) (*GuestClaims, error) {
	f := informers.NewSharedInformerFactory(client, 0)
	g := &GuestClaims{client: client, driver: driverName, factory: f, pods: f.Core().V1().Pods().Informer(), started: make(chan struct{})}
	// Every pod of the guest stays in memory: keep only what the decision
	// reads.
	if err := g.pods.SetTransform(trimPod); err != nil {
		return nil, err
	}
	if err := g.pods.AddIndexers(cache.Indexers{indexPodClaim: func(obj any) ([]string, error) {
		p, ok := obj.(*corev1.Pod)
		if !ok {
			return nil, nil
		}
		var keys []string
		for _, c := range podClaims(p) {
			keys = append(keys, p.Namespace+"/"+c)
		}
		return keys, nil
	}}); err != nil {
		return nil, err
	}
	return g, nil
}

// Start runs the pod informer until stop is closed.
func (g *GuestClaims) Start(stop <-chan struct{}) {
	g.factory.Start(stop)
	close(g.started)
}

// Synced reports whether the pod cache has listed once.
func (g *GuestClaims) Synced() bool {
	select {
	case <-g.started:
		return g.pods.HasSynced()
	default:
		return false
	}
}

// Users implements ClaimUsers.
func (g *GuestClaims) Users(ctx context.Context, volume string, fresh bool) ([]string, error) {
	pv, err := g.guestPV(ctx, volume)
	if err != nil {
		return nil, err
	}
	if pv == nil || pv.Spec.ClaimRef == nil {
		return nil, nil // no guest PV, or no claim: no pod can mount it
	}
	ns, claim := pv.Spec.ClaimRef.Namespace, pv.Spec.ClaimRef.Name
	var pods []*corev1.Pod
	if fresh {
		list, err := g.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil, fmt.Errorf("list guest pods in %s: %w", ns, err)
		}
		for i := range list.Items {
			pods = append(pods, &list.Items[i])
		}
	} else {
		if !g.Synced() {
			return nil, errors.New("the guest pod cache has not synced (the controller needs get, list and watch on pods)")
		}
		objs, err := g.pods.GetIndexer().ByIndex(indexPodClaim, ns+"/"+claim)
		if err != nil {
			return nil, err
		}
		for _, o := range objs {
			pods = append(pods, o.(*corev1.Pod))
		}
	}
	var users []string
	for _, p := range pods {
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue // finished: its volumes are unmounted
		}
		for _, c := range podClaims(p) {
			if c == claim {
				node := p.Spec.NodeName
				if node == "" {
					node = "no node yet"
				}
				users = append(users, fmt.Sprintf("%s/%s on %s", p.Namespace, p.Name, node))
				break
			}
		}
	}
	sort.Strings(users)
	return users, nil
}

// guestPV finds the guest PV of a volume: named after it when the
// provisioner's name was a valid volume ID (always, for pvc-<uid>), else by
// its volume handle.
func (g *GuestClaims) guestPV(ctx context.Context, volume string) (*corev1.PersistentVolume, error) {
	pv, err := g.client.CoreV1().PersistentVolumes().Get(ctx, volume, metav1.GetOptions{})
	switch {
	case err == nil && pv.Spec.CSI != nil && pv.Spec.CSI.Driver == g.driver && pv.Spec.CSI.VolumeHandle == volume:
		return pv, nil
	case err != nil && !apierrors.IsNotFound(err):
		return nil, fmt.Errorf("get guest PV %s: %w", volume, err)
	}
	list, err := g.client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list guest PVs: %w", err)
	}
	for i := range list.Items {
		if c := list.Items[i].Spec.CSI; c != nil && c.Driver == g.driver && c.VolumeHandle == volume {
			return &list.Items[i], nil
		}
	}
	return nil, nil
}

// podClaims are the names of the claims a pod mounts, generic ephemeral
// volumes included (their claim is <pod>-<volume>).
func podClaims(p *corev1.Pod) []string {
	var out []string
	for _, v := range p.Spec.Volumes {
		switch {
		case v.PersistentVolumeClaim != nil:
			out = append(out, v.PersistentVolumeClaim.ClaimName)
		case v.Ephemeral != nil:
			out = append(out, p.Name+"-"+v.Name)
		}
	}
	return out
}

// trimPod keeps a pod's identity, node, phase and claim volumes.
func trimPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	out := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace, UID: p.UID, ResourceVersion: p.ResourceVersion, DeletionTimestamp: p.DeletionTimestamp},
		Spec:       corev1.PodSpec{NodeName: p.Spec.NodeName},
		Status:     corev1.PodStatus{Phase: p.Status.Phase},
	}
	for _, v := range p.Spec.Volumes {
		switch {
		case v.PersistentVolumeClaim != nil:
			out.Spec.Volumes = append(out.Spec.Volumes, corev1.Volume{Name: v.Name, VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: v.PersistentVolumeClaim.ClaimName}}})
		case v.Ephemeral != nil:
			out.Spec.Volumes = append(out.Spec.Volumes, corev1.Volume{Name: v.Name, VolumeSource: corev1.VolumeSource{Ephemeral: &corev1.EphemeralVolumeSource{}}})
		}
	}
	return out, nil
}
