package kubevirtsim

import (
	"context"
	"fmt"
	"slices"
	"strings"
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

// wantsBinding reports whether the host provisioner handles this claim.
func (s *Sim) wantsBinding(pvc *corev1.PersistentVolumeClaim) bool {
	class := ""
	if pvc.Spec.StorageClassName != nil {
		class = *pvc.Spec.StorageClassName
	}
	return class == s.opts.StorageClass || (class == "" && s.opts.BindClasslessPVCs)
}

// syncPVC is the host "Longhorn" provisioner plus the bits of the PV
// controller these tests need: it creates a PV for a pending claim of the
// class, binds both and writes the claim's status; when a bound claim is
// gone it deletes its PV.
func (s *Sim) syncPVC(ctx context.Context, key string) (time.Duration, error) {
	if pv, ok := strings.CutPrefix(key, pvDeletePrefix); ok {
		return 0, s.deletePV(ctx, pv)
	}
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	pvc, err := s.pvcLister.PersistentVolumeClaims(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	if pvc.DeletionTimestamp != nil {
		return 0, s.releasePVC(ctx, pvc)
	}
	if !s.wantsBinding(pvc) {
		return 0, nil
	}
	if pvc.Status.Phase == corev1.ClaimBound {
		return 0, s.growPVC(ctx, pvc)
	}
	now := time.Now()
	s.mu.Lock()
	first, seen := s.pvcSeen[pvc.UID]
	if !seen {
		first = now
		s.pvcSeen[pvc.UID] = now
	}
	s.mu.Unlock()
	if at := first.Add(s.jit.d(s.t.Bind)); now.Before(at) && pvc.Spec.VolumeName == "" {
		return at.Sub(now), nil
	}
	log := s.log.WithValues("pvc", key)

	// external-provisioner's restore: a claim from a VolumeSnapshot waits
	// until the snapshot is ready and fits (snapshot events requeue it); the
	// data is restored once, before the claim binds (a pass on a stale cache
	// must not restore over data written since, nor wait again).
	if src, ok := restoreSource(pvc); ok && pvc.Spec.VolumeName == "" {
		s.mu.Lock()
		done := s.restored[pvc.UID]
		s.mu.Unlock()
		if !done {
			if why := s.restoreBlocked(pvc, src); why != "" {
				s.setRestoreWait(pvc.UID, why)
				log.V(2).Info("restore waits for its snapshot", "snapshot", src.namespace+"/"+src.name, "reason", why)
				return 0, nil
			}
			if h := s.snapshotHook(); h != nil {
				if err := h.Restore(ctx, src.namespace+"/"+src.name, pvc.Name); err != nil {
					s.setRestoreWait(pvc.UID, "restore failed: "+err.Error())
					return 0, fmt.Errorf("restore hook: %w", err)
				}
			}
			s.mu.Lock()
			s.restored[pvc.UID] = true
			s.mu.Unlock()
			log.V(2).Info("restored from snapshot", "snapshot", src.namespace+"/"+src.name)
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
	class := s.opts.StorageClass
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
	created, err := s.kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
	switch {
	case apierrors.IsAlreadyExists(err):
		if created, err = s.kube.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{}); err != nil {
			return 0, err
		}
	case err != nil:
		return 0, err
	}
	if created.Status.Phase != corev1.VolumeBound {
		created.Status.Phase = corev1.VolumeBound
		if _, err := s.kube.CoreV1().PersistentVolumes().UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
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
		if claim, err = s.kube.CoreV1().PersistentVolumeClaims(ns).Update(ctx, claim, metav1.UpdateOptions{}); err != nil {
			return 0, err
		}
	}
	claim.Status.Phase = corev1.ClaimBound
	claim.Status.AccessModes = pv.Spec.AccessModes
	claim.Status.Capacity = corev1.ResourceList{corev1.ResourceStorage: size}
	if _, err := s.kube.CoreV1().PersistentVolumeClaims(ns).UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
		return 0, err
	}
	s.mu.Lock()
	delete(s.pvcSeen, pvc.UID)
	delete(s.restoreWait, pvc.UID)
	s.mu.Unlock()
	log.V(2).Info("PVC bound", "pv", pvName)
	return 0, nil
}

// setRestoreWait notes why a restoring claim is still Pending (what
// external-provisioner would report in a ProvisioningFailed event) and wakes
// waiters; tests wait on it to know the gate was reached.
func (s *Sim) setRestoreWait(uid types.UID, why string) {
	s.mu.Lock()
	changed := s.restoreWait[uid] != why
	s.restoreWait[uid] = why
	s.mu.Unlock()
	if changed {
		s.changed.notify()
	}
}

// growPVC plays Longhorn's online expansion and the resize controller: a
// bound claim whose request grew gets a PV and a status of the new size.
func (s *Sim) growPVC(ctx context.Context, pvc *corev1.PersistentVolumeClaim) error {
	want := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	have := pvc.Status.Capacity[corev1.ResourceStorage]
	if want.Cmp(have) <= 0 || pvc.Spec.VolumeName == "" {
		return nil
	}
	pv, err := s.kube.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		return err
	}
	pv.Spec.Capacity = corev1.ResourceList{corev1.ResourceStorage: want}
	if _, err := s.kube.CoreV1().PersistentVolumes().Update(ctx, pv, metav1.UpdateOptions{}); err != nil {
		return err
	}
	claim := pvc.DeepCopy()
	claim.Status.Capacity = corev1.ResourceList{corev1.ResourceStorage: want}
	if _, err := s.kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
		return err
	}
	s.log.V(2).Info("PVC expanded", "pvc", pvc.Namespace+"/"+pvc.Name, "size", want.String())
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
func (s *Sim) releasePVC(ctx context.Context, pvc *corev1.PersistentVolumeClaim) error {
	if !slices.Contains(pvc.Finalizers, pvcProtection) {
		return nil
	}
	pods, _ := s.podLister.Pods(pvc.Namespace).List(labels.Everything())
	for _, p := range pods {
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		for _, v := range p.Spec.Volumes {
			if v.PersistentVolumeClaim != nil && v.PersistentVolumeClaim.ClaimName == pvc.Name {
				return nil // in use; pod events bring us back
			}
		}
	}
	return s.dropFinalizer(ctx, pvc.Finalizers, pvcProtection, func(patch []byte) error {
		_, err := s.kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).Patch(ctx, pvc.Name, types.JSONPatchType, patch, metav1.PatchOptions{})
		return err
	})
}

// deletePV deletes a released volume (reclaim policy Delete) and lifts its
// protection finalizer.
func (s *Sim) deletePV(ctx context.Context, name string) error {
	err := s.kube.CoreV1().PersistentVolumes().Delete(ctx, name, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	pv, err := s.kube.CoreV1().PersistentVolumes().Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	return s.dropFinalizer(ctx, pv.Finalizers, pvProtection, func(patch []byte) error {
		_, err := s.kube.CoreV1().PersistentVolumes().Patch(ctx, name, types.JSONPatchType, patch, metav1.PatchOptions{})
		return err
	})
}

func (s *Sim) dropFinalizer(ctx context.Context, have []string, drop string, apply func([]byte) error) error {
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
