package guest

import (
	"errors"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

const indexPVHandle = "pvHandle"

// errPVsNotSynced answers a reader of the guest PV cache before its first
// list: an empty cache would say that no volume is this cluster's.
var errPVsNotSynced = errors.New("the guest PersistentVolume cache has not synced (the controller needs list and watch on persistentvolumes)")

// pvHandleIndex indexes the PVs of this driver by their volume handle (the
// host PVC), which is how each reader looks one up: the PV's own name is
// the provisioner's, and equals the handle only for volumes it named.
func (n *Nodes) pvHandleIndex(obj any) ([]string, error) {
	pv, ok := obj.(*corev1.PersistentVolume)
	if !ok || pv.Spec.CSI == nil || pv.Spec.CSI.Driver != n.driver || pv.Spec.CSI.VolumeHandle == "" {
		return nil, nil
	}
	return []string{pv.Spec.CSI.VolumeHandle}, nil
}

// trimPV keeps what the readers of the cache use of a PV (its CSI driver and
// handle, its claim): every PV of the guest stays in memory.
func trimPV(obj any) (any, error) {
	pv, ok := obj.(*corev1.PersistentVolume)
	if !ok {
		return obj, nil
	}
	out := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: pv.Name, UID: pv.UID, ResourceVersion: pv.ResourceVersion,
		DeletionTimestamp: pv.DeletionTimestamp}}
	if csi := pv.Spec.CSI; csi != nil {
		out.Spec.CSI = &corev1.CSIPersistentVolumeSource{Driver: csi.Driver, VolumeHandle: csi.VolumeHandle}
	}
	if ref := pv.Spec.ClaimRef; ref != nil {
		out.Spec.ClaimRef = &corev1.ObjectReference{Kind: ref.Kind, Namespace: ref.Namespace, Name: ref.Name, UID: ref.UID}
	}
	return out, nil
}

// PVsSynced reports whether the guest PV cache has listed once. It is apart
// from HasSynced: the detach guard reads no PV, and must not wait for them.
func (n *Nodes) PVsSynced() bool { return n.pvs.HasSynced() }

// cachedPV is the guest PV of this driver whose volume handle is volume,
// from the cache: the one named after it if several are (a static PV made
// by hand beside the provisioner's), else the first by name.
func (n *Nodes) cachedPV(volume string) (*corev1.PersistentVolume, error) {
	if !n.PVsSynced() {
		return nil, errPVsNotSynced
	}
	objs, err := n.pvs.GetIndexer().ByIndex(indexPVHandle, volume)
	if err != nil {
		return nil, err
	}
	var pvs []*corev1.PersistentVolume
	for _, o := range objs {
		if pv, ok := o.(*corev1.PersistentVolume); ok {
			pvs = append(pvs, pv)
		}
	}
	if len(pvs) == 0 {
		return nil, nil
	}
	slices.SortFunc(pvs, func(a, b *corev1.PersistentVolume) int { return strings.Compare(a.Name, b.Name) })
	if i := slices.IndexFunc(pvs, func(pv *corev1.PersistentVolume) bool { return pv.Name == volume }); i >= 0 {
		return pvs[i], nil
	}
	return pvs[0], nil
}

// cachedOwned is which host PVCs are this guest cluster's, from the cache.
func (n *Nodes) cachedOwned() (Owned, error) {
	if !n.PVsSynced() {
		return Owned{}, errPVsNotSynced
	}
	o := newOwned()
	for _, obj := range n.pvs.GetStore().List() {
		if pv, ok := obj.(*corev1.PersistentVolume); ok {
			o.add(n.driver, pv)
		}
	}
	return o, nil
}
