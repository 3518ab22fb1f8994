package kubevirtsim

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
)

// longhornSizeStep is Longhorn's volume size granularity: its CSI
// controller rounds every request up to 2 MiB before it compares a clone
// with its source.
const longhornSizeStep = 2 << 20

// cloneSource is the name of the PVC pvc is cloned from, if any (dataSourceRef
// wins over dataSource, as Kubernetes fills both).
func cloneSource(pvc *corev1.PersistentVolumeClaim) (string, bool) {
	if r := pvc.Spec.DataSourceRef; r != nil {
		ns := ptr.Deref(r.Namespace, pvc.Namespace)
		if ptr.Deref(r.APIGroup, "") == "" && r.Kind == "PersistentVolumeClaim" && ns == pvc.Namespace {
			return r.Name, true
		}
		return "", false
	}
	if r := pvc.Spec.DataSource; r != nil && ptr.Deref(r.APIGroup, "") == "" && r.Kind == "PersistentVolumeClaim" {
		return r.Name, true
	}
	return "", false
}

// enqueueClonesOf queues the pending clones of source (in ns).
func (p *provisioner) enqueueClonesOf(ns, source string) {
	objs, _ := p.c.pvcInf.GetIndexer().ByIndex(cache.NamespaceIndex, ns)
	for _, o := range objs {
		if pvc, ok := o.(*corev1.PersistentVolumeClaim); ok && pvc.Spec.VolumeName == "" {
			if src, ok := cloneSource(pvc); ok && src == source {
				p.queue.Add(ns + "/" + pvc.Name)
			}
		}
	}
}

// clone copies the source's data into a pending clone once, or notes why it
// cannot be cloned (setRestoreWait) and leaves it Pending, as
// external-provisioner does after a failed CreateVolume.
func (p *provisioner) clone(ctx context.Context, pvc *corev1.PersistentVolumeClaim, source string) error {
	p.mu.Lock()
	done := p.restored[pvc.UID]
	p.mu.Unlock()
	if done {
		return nil
	}
	if why := p.cloneBlocked(pvc, source); why != "" {
		p.setRestoreWait(pvc.UID, why)
		p.c.log.V(2).Info("clone waits for its source", "pvc", pvc.Namespace+"/"+pvc.Name, "source", source, "reason", why)
		return nil
	}
	if h, ok := p.c.opts.DiskHook.(CloneHook); ok {
		if err := h.Clone(ctx, source, pvc.Name); err != nil {
			p.setRestoreWait(pvc.UID, "clone failed: "+err.Error())
			return fmt.Errorf("clone hook: %w", err)
		}
	}
	p.mu.Lock()
	p.restored[pvc.UID] = true
	delete(p.restoreWait, pvc.UID)
	p.mu.Unlock()
	p.c.log.V(2).Info("cloned from PVC", "pvc", pvc.Namespace+"/"+pvc.Name, "source", source)
	return nil
}

// cloneBlocked says why pvc cannot be cloned from source ("" when it can),
// with the messages of external-provisioner v5.3.0
// pkg/controller/controller.go (getPVCSource: the source bound and not being
// deleted, at most the request's size, the same volume mode) and of
// longhorn-manager v1.10.1 csi/controller_server.go:201-202 (a clone has
// exactly its source's size, both rounded up to 2 MiB). Neither compares
// storage classes.
func (p *provisioner) cloneBlocked(pvc *corev1.PersistentVolumeClaim, source string) string {
	src, err := p.c.pvcLister.PersistentVolumeClaims(pvc.Namespace).Get(source)
	if apierrors.IsNotFound(err) || err != nil {
		return fmt.Sprintf("error getting PVC %s (namespace %q) from api server: %v", source, pvc.Namespace, err)
	}
	if src.Status.Phase != corev1.ClaimBound {
		return fmt.Sprintf("the PVC DataSource %s must have a status of Bound.  Got %v", source, src.Status)
	}
	if src.DeletionTimestamp != nil {
		return fmt.Sprintf("the PVC DataSource %s is currently being deleted", source)
	}
	want := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	have := src.Spec.Resources.Requests[corev1.ResourceStorage]
	if want.Value() < have.Value() {
		return fmt.Sprintf("error, new PVC request must be greater than or equal in size to the specified PVC data source, requested %v but source is %v", want.Value(), have.Value())
	}
	srcMode, mode := volumeModeOf(src), volumeModeOf(pvc)
	if srcMode != mode {
		return fmt.Sprintf("the source PVC and destination PVCs must have the same volume mode for cloning.  Source is %s, but new PVC requested %s", srcMode, mode)
	}
	if req, size := roundToLonghorn(want.Value()), roundToLonghorn(have.Value()); req != size {
		return fmt.Sprintf("rpc error: code = OutOfRange desc = failed to clone volume: the requested size (%v bytes) is different than the source volume size (%v bytes)", req, size)
	}
	return ""
}

func volumeModeOf(pvc *corev1.PersistentVolumeClaim) corev1.PersistentVolumeMode {
	return ptr.Deref(pvc.Spec.VolumeMode, corev1.PersistentVolumeFilesystem)
}

func roundToLonghorn(bytes int64) int64 {
	return (bytes + longhornSizeStep - 1) / longhornSizeStep * longhornSizeStep
}
