package kubevirtsim

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
)

const pvDeletePrefix = "pv-delete:"

// provisioner is the host "Longhorn" provisioner plus the bits of the PV
// controller, the PVC and PV protection controllers and the resizer these
// tests need.
type provisioner struct {
	c         *cluster
	snapshots *snapshotter // restores read its snapshots
	queue     workQueue

	mu sync.Mutex
	// seen is when each pending claim was first seen; restoreWait why each
	// restoring claim is still Pending; restored the claims restored
	// already.
	seen        map[types.UID]time.Time
	restoreWait map[types.UID]string
	restored    map[types.UID]bool
}

func newProvisioner(c *cluster) *provisioner {
	return &provisioner{
		c: c, queue: newWorkQueue("pvc", c.t.BackoffBase, c.t.HandlerPoll),
		seen: map[types.UID]time.Time{}, restoreWait: map[types.UID]string{}, restored: map[types.UID]bool{},
	}
}

func (p *provisioner) register() {
	_, _ = p.c.pvcInf.AddEventHandler(onEvent(func(obj any) {
		p.queue.Add(objectKey(obj))
		if pvc, ok := obj.(*corev1.PersistentVolumeClaim); ok {
			p.enqueueClonesOf(pvc.Namespace, pvc.Name) // a source that binds frees its clones
		}
	}))
	_, _ = p.c.pvcInf.AddEventHandler(onDelete(func(obj any) {
		pvc, ok := obj.(*corev1.PersistentVolumeClaim)
		if !ok {
			return
		}
		p.mu.Lock()
		delete(p.seen, pvc.UID)
		delete(p.restoreWait, pvc.UID)
		delete(p.restored, pvc.UID)
		p.mu.Unlock()
		if pvc.Spec.VolumeName != "" && p.wantsBinding(pvc) {
			p.queue.Add(pvDeletePrefix + pvc.Spec.VolumeName)
		}
	}))
	_, _ = p.c.podInf.AddEventHandler(onDelete(func(obj any) {
		if pod, ok := obj.(*corev1.Pod); ok {
			for _, claim := range podClaims(pod) { // a deleted claim may be free now
				p.queue.Add(pod.Namespace + "/" + claim)
			}
		}
	}))
}

func (p *provisioner) run(ctx context.Context) { p.queue.run(ctx, p.c, 2, p.sync) }
func (p *provisioner) shutdown()               { p.queue.ShutDown() }

// wantsBinding reports whether the host provisioner handles this claim.
func (p *provisioner) wantsBinding(pvc *corev1.PersistentVolumeClaim) bool {
	class := ""
	if pvc.Spec.StorageClassName != nil {
		class = *pvc.Spec.StorageClassName
	}
	return class == p.c.opts.StorageClass || (class == "" && p.c.opts.BindClasslessPVCs)
}

// enqueueRestoresOf queues the claims restoring from snapshot (in ns), so a
// claim waiting for its snapshot is retried when the snapshot changes.
func (p *provisioner) enqueueRestoresOf(ns, snapshot string) {
	objs, _ := p.c.pvcInf.GetIndexer().ByIndex(cache.NamespaceIndex, ns)
	for _, o := range objs {
		if pvc, ok := o.(*corev1.PersistentVolumeClaim); ok {
			if src, ok := restoreSource(pvc); ok && src.namespace == ns && src.name == snapshot {
				p.queue.Add(ns + "/" + pvc.Name)
			}
		}
	}
}

// sync creates a PV for a pending claim of the class, binds both and writes
// the claim's status; when a bound claim is gone it deletes its PV.
func (p *provisioner) sync(ctx context.Context, key string) (time.Duration, error) {
	if pv, ok := strings.CutPrefix(key, pvDeletePrefix); ok {
		return 0, p.deletePV(ctx, pv)
	}
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	pvc, err := p.c.pvcLister.PersistentVolumeClaims(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	if pvc.DeletionTimestamp != nil {
		return 0, p.releasePVC(ctx, pvc)
	}
	if !p.wantsBinding(pvc) {
		return 0, nil
	}
	if pvc.Status.Phase == corev1.ClaimBound {
		return 0, p.growPVC(ctx, pvc)
	}
	if pvc.Status.Phase == corev1.ClaimLost {
		return 0, nil // a test made it so: leave it alone
	}
	now := time.Now()
	p.mu.Lock()
	first, seen := p.seen[pvc.UID]
	if !seen {
		first = now
		p.seen[pvc.UID] = now
	}
	p.mu.Unlock()
	if at := first.Add(p.c.jit.d(p.c.t.Bind)); now.Before(at) && pvc.Spec.VolumeName == "" {
		return at.Sub(now), nil
	}
	log := p.c.log.WithValues("pvc", key)

	// external-provisioner's restore: a claim from a VolumeSnapshot waits
	// until the snapshot is ready and fits (snapshot events requeue it); the
	// data is restored once, before the claim binds (a pass on a stale cache
	// must not restore over data written since, nor wait again).
	if src, ok := restoreSource(pvc); ok && pvc.Spec.VolumeName == "" {
		p.mu.Lock()
		done := p.restored[pvc.UID]
		p.mu.Unlock()
		if !done {
			if why := p.snapshots.restoreBlocked(pvc, src); why != "" {
				p.setRestoreWait(pvc.UID, why)
				log.V(2).Info("restore waits for its snapshot", "snapshot", src.namespace+"/"+src.name, "reason", why)
				return 0, nil
			}
			if h := p.c.snapshotHook(); h != nil {
				if err := h.Restore(ctx, p.snapshots.dataKey(ctx, src), pvc.Name); err != nil {
					p.setRestoreWait(pvc.UID, "restore failed: "+err.Error())
					return 0, fmt.Errorf("restore hook: %w", err)
				}
			}
			p.mu.Lock()
			p.restored[pvc.UID] = true
			p.mu.Unlock()
			log.V(2).Info("restored from snapshot", "snapshot", src.namespace+"/"+src.name)
		}
	}

	if src, ok := cloneSource(pvc); ok && pvc.Spec.VolumeName == "" {
		if err := p.clone(ctx, pvc, src); err != nil {
			return 0, err
		}
		p.mu.Lock()
		waiting := p.restoreWait[pvc.UID] != ""
		p.mu.Unlock()
		if waiting {
			return 0, nil // source events bring us back
		}
	}

	pvName := pvc.Spec.VolumeName
	if pvName == "" {
		pvName = "pvc-" + string(pvc.UID)
	}
	size := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	if size.IsZero() {
		size = resource.MustParse("1Gi")
	}
	if h := p.c.opts.ProvisionHook; h != nil {
		if err := h(ctx, pvc, pvName, size); err != nil {
			return 0, fmt.Errorf("provision hook of PV %s: %w", pvName, err)
		}
	}
	class := p.c.opts.StorageClass
	if pvc.Spec.StorageClassName != nil {
		class = *pvc.Spec.StorageClassName
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{
			Name:        pvName,
			Annotations: map[string]string{"pv.kubernetes.io/provisioned-by": LonghornProvisioner},
		},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: size},
			AccessModes: pvc.Spec.AccessModes,
			ClaimRef: &corev1.ObjectReference{
				APIVersion: "v1", Kind: "PersistentVolumeClaim", Namespace: pvc.Namespace, Name: pvc.Name,
				UID: pvc.UID, ResourceVersion: pvc.ResourceVersion,
			},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
			StorageClassName:              class,
			VolumeMode:                    pvc.Spec.VolumeMode,
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: LonghornProvisioner, VolumeHandle: pvName, FSType: "ext4",
			}},
		},
	}
	if len(pv.Spec.AccessModes) == 0 {
		pv.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}
	}
	created, err := p.c.kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
	switch {
	case apierrors.IsAlreadyExists(err):
		if created, err = p.c.kube.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{}); err != nil {
			return 0, err
		}
	case err != nil:
		return 0, err
	}
	if created.Status.Phase != corev1.VolumeBound {
		created.Status.Phase = corev1.VolumeBound
		if _, err := p.c.kube.CoreV1().PersistentVolumes().UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
			return 0, err
		}
	}

	claim := pvc.DeepCopy()
	if claim.Spec.VolumeName == "" {
		claim.Spec.VolumeName = pvName
		if claim.Annotations == nil {
			claim.Annotations = map[string]string{}
		}
		claim.Annotations["pv.kubernetes.io/bind-completed"] = "yes"
		claim.Annotations["pv.kubernetes.io/bound-by-controller"] = "yes"
		claim.Annotations["volume.kubernetes.io/storage-provisioner"] = LonghornProvisioner
		if claim, err = p.c.kube.CoreV1().PersistentVolumeClaims(ns).Update(ctx, claim, metav1.UpdateOptions{}); err != nil {
			return 0, err
		}
	}
	claim.Status.Phase = corev1.ClaimBound
	claim.Status.AccessModes = pv.Spec.AccessModes
	claim.Status.Capacity = corev1.ResourceList{corev1.ResourceStorage: size}
	if _, err := p.c.kube.CoreV1().PersistentVolumeClaims(ns).UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
		return 0, err
	}
	p.mu.Lock()
	delete(p.seen, pvc.UID)
	delete(p.restoreWait, pvc.UID)
	p.mu.Unlock()
	log.V(2).Info("PVC bound", "pv", pvName)
	return 0, nil
}

// setRestoreWait notes why a restoring claim is still Pending (what
// external-provisioner would report in a ProvisioningFailed event) and wakes
// waiters; tests wait on it to know the gate was reached.
func (p *provisioner) setRestoreWait(uid types.UID, why string) {
	p.mu.Lock()
	changed := p.restoreWait[uid] != why
	p.restoreWait[uid] = why
	p.mu.Unlock()
	if changed {
		p.c.changed.notify()
	}
}

// restoreWaitOf is why a restoring claim is still Pending ("" if it is not
// waiting).
func (p *provisioner) restoreWaitOf(uid types.UID) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.restoreWait[uid]
}

// growPVC plays Longhorn's online expansion and the resize controller: a
// bound claim whose request grew gets a PV and a status of the new size.
func (p *provisioner) growPVC(ctx context.Context, pvc *corev1.PersistentVolumeClaim) error {
	want := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	have := pvc.Status.Capacity[corev1.ResourceStorage]
	if want.Cmp(have) <= 0 || pvc.Spec.VolumeName == "" {
		return nil
	}
	pv, err := p.c.kube.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		return err
	}
	pv.Spec.Capacity = corev1.ResourceList{corev1.ResourceStorage: want}
	if _, err := p.c.kube.CoreV1().PersistentVolumes().Update(ctx, pv, metav1.UpdateOptions{}); err != nil {
		return err
	}
	claim := pvc.DeepCopy()
	claim.Status.Capacity = corev1.ResourceList{corev1.ResourceStorage: want}
	if _, err := p.c.kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
		return err
	}
	p.c.log.V(2).Info("PVC expanded", "pvc", pvc.Namespace+"/"+pvc.Name, "size", want.String())
	return nil
}

// Finalizers the API server's admission adds and kube-controller-manager
// removes; no controller manager runs here, so the simulator removes them.
const (
	pvcProtection = "kubernetes.io/pvc-protection"
	pvProtection  = "kubernetes.io/pv-protection"
)

// releasePVC plays the PVC protection controller: a deleted claim goes away
// once no attachment pod uses it.
func (p *provisioner) releasePVC(ctx context.Context, pvc *corev1.PersistentVolumeClaim) error {
	if !slices.Contains(pvc.Finalizers, pvcProtection) {
		return nil
	}
	pods, _ := p.c.podLister.Pods(pvc.Namespace).List(labels.Everything())
	for _, pod := range pods {
		if pod.Status.Phase != corev1.PodSucceeded && pod.Status.Phase != corev1.PodFailed && slices.Contains(podClaims(pod), pvc.Name) {
			return nil // in use; pod events bring us back
		}
	}
	return p.c.dropFinalizer(ctx, pvc.Finalizers, pvcProtection, func(patch []byte) error {
		_, err := p.c.kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).Patch(ctx, pvc.Name, types.JSONPatchType, patch, metav1.PatchOptions{})
		return err
	})
}

// deletePV deletes a released volume (reclaim policy Delete) and lifts its
// protection finalizer.
func (p *provisioner) deletePV(ctx context.Context, name string) error {
	err := p.c.kube.CoreV1().PersistentVolumes().Delete(ctx, name, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	pv, err := p.c.kube.CoreV1().PersistentVolumes().Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	return p.c.dropFinalizer(ctx, pv.Finalizers, pvProtection, func(patch []byte) error {
		_, err := p.c.kube.CoreV1().PersistentVolumes().Patch(ctx, name, types.JSONPatchType, patch, metav1.PatchOptions{})
		return err
	})
}

func (c *cluster) dropFinalizer(ctx context.Context, have []string, drop string, apply func([]byte) error) error {
	if !slices.Contains(have, drop) {
		return nil
	}
	keep := slices.DeleteFunc(slices.Clone(have), func(f string) bool { return f == drop })
	patch, err := casPatch(casOp{"/metadata/finalizers", have, keep, true})
	if err != nil {
		return err
	}
	if err := apply(patch); err != nil && !apierrors.IsNotFound(err) {
		return err
	}
	return ctx.Err()
}
