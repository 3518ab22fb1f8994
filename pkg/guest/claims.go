package guest

import (
	"context"
	"errors"
	"fmt"
	"sort"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// Claims watches the guest cluster's pods to tell which still use the
// claim of a ReadWriteMany volume (ClaimUsers), and the guest's
// VolumeAttachments to tell which nodes the volume is published to
// (GuestAttachments); both find the volume's guest PV in the shared PV
// cache of Nodes, or on the API server when asked for a fresh answer. It
// runs on every controller replica, since whichever replica the attacher
// reaches answers the unpublish; it is started only when RWX volumes are
// served.
type Claims struct {
	client      kubernetes.Interface
	driver      string
	vmOf        func(node string) string
	cachedPV    func(volume string) (*corev1.PersistentVolume, error)
	pvsSynced   func() bool
	factory     informers.SharedInformerFactory
	pods        cache.SharedIndexInformer
	attachments cache.SharedIndexInformer
	started     chan struct{}
}

const (
	indexPodClaim = "claim"
	indexVAPV     = "pv"
)

// NewClaims builds the pod cache; Start runs it. The VolumeAttachments,
// the PVs and the VM (node ID) of each guest Node come from the guest
// caches the detach guard and the node monitor read (nodes runs them), so
// the guest is watched once.
func NewClaims(client kubernetes.Interface, driverName string, nodes *Nodes) (*Claims, error) {
	f := informers.NewSharedInformerFactory(client, 0)
	g := &Claims{client: client, driver: driverName, vmOf: nodes.VMOfNode, cachedPV: nodes.cachedPV,
		pvsSynced: nodes.PVsSynced, factory: f, pods: f.Core().V1().Pods().Informer(),
		attachments: nodes.AttachmentInformer(), started: make(chan struct{})}
	if err := g.attachments.AddIndexers(cache.Indexers{indexVAPV: func(obj any) ([]string, error) {
		if va, ok := obj.(*storagev1.VolumeAttachment); ok && va.Spec.Attacher == driverName && va.Spec.Source.PersistentVolumeName != nil {
			return []string{*va.Spec.Source.PersistentVolumeName}, nil
		}
		return nil, nil
	}}); err != nil {
		return nil, err
	}
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
func (g *Claims) Start(stop <-chan struct{}) {
	g.factory.Start(stop)
	close(g.started)
}

// Synced reports whether the pod, VolumeAttachment and PV caches have
// listed once.
func (g *Claims) Synced() bool {
	select {
	case <-g.started:
		return g.pods.HasSynced() && g.attachments.HasSynced() && g.pvsSynced()
	default:
		return false
	}
}

// Attachment is one of this driver's guest VolumeAttachments of a volume.
type Attachment struct {
	Name, Node string
	// VM is the node ID of the Node: the VM it runs on.
	VM       string
	Attached bool
	// Deleting: the attach/detach controller detaches it, which it does
	// only once the Node no longer uses the volume (or gave up waiting).
	Deleting bool
}

func (a Attachment) String() string {
	return fmt.Sprintf("%s (node %s, VM %s, attached %t)", a.Name, a.Node, a.VM, a.Attached)
}

// Attachments implements GuestAttachments: this driver's VolumeAttachments
// of the volume's guest PV, sorted by name. fresh lists them from the API
// server instead of the cache.
func (g *Claims) Attachments(ctx context.Context, volume string, fresh bool) ([]Attachment, error) {
	if !fresh && !g.Synced() {
		return nil, errors.New("the guest pod, VolumeAttachment and PersistentVolume caches have not synced (the controller needs list and watch on pods, volumeattachments and persistentvolumes)")
	}
	pv, err := g.guestPV(ctx, volume, fresh)
	if err != nil || pv == nil {
		return nil, err // no guest PV: nothing can be attached
	}
	var vas []*storagev1.VolumeAttachment
	if fresh {
		list, err := g.client.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil, fmt.Errorf("list guest VolumeAttachments: %w", err)
		}
		for i := range list.Items {
			vas = append(vas, &list.Items[i])
		}
	} else {
		objs, err := g.attachments.GetIndexer().ByIndex(indexVAPV, pv.Name)
		if err != nil {
			return nil, err
		}
		for _, o := range objs {
			vas = append(vas, o.(*storagev1.VolumeAttachment))
		}
	}
	var out []Attachment
	for _, va := range vas {
		if va.Spec.Attacher != g.driver || va.Spec.Source.PersistentVolumeName == nil || *va.Spec.Source.PersistentVolumeName != pv.Name {
			continue
		}
		out = append(out, Attachment{Name: va.Name, Node: va.Spec.NodeName, VM: g.vmOf(va.Spec.NodeName),
			Attached: va.Status.Attached, Deleting: va.DeletionTimestamp != nil})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Users implements ClaimUsers.
func (g *Claims) Users(ctx context.Context, volume string, fresh bool) ([]string, error) {
	pv, err := g.guestPV(ctx, volume, fresh)
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
// its volume handle. fresh reads it from the API server: a fresh answer
// confirms that an export may be disabled or deleted, and then the PV and
// its claim must not come from a cache that may lag behind the pods and
// VolumeAttachments listed beside it.
func (g *Claims) guestPV(ctx context.Context, volume string, fresh bool) (*corev1.PersistentVolume, error) {
	if !fresh {
		return g.cachedPV(volume)
	}
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
