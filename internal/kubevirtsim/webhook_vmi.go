package kubevirtsim

import (
	"encoding/json"
	"fmt"
	"slices"

	admissionv1 "k8s.io/api/admission/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// admitVMIUpdate is the storage part of virt-api's VMI update validator
// (v1.7.0 pkg/storage/admitters/storagehotplug.go:36 AdmitHotplugStorage,
// called from vmi-update-admitter.go:179; v1.6.3 vmi-update-admitter.go:160;
// v1.5.3 vmi-update-admitter.go:144 admitStorageUpdate). Every change of a
// VMI's volumes and disks passes here, the declarative controller's patch
// and virt-api's VMI subresource patch alike, so one bad disk fails the
// whole patch. Not simulated: the rule that only KubeVirt's service
// accounts may change a VMI spec, and the CPU and memory hotplug checks.
func (w *webhooks) admitVMIUpdate(req *admissionv1.AdmissionRequest) []metav1.StatusCause {
	newVMI, oldVMI := &kubevirtv1.VirtualMachineInstance{}, &kubevirtv1.VirtualMachineInstance{}
	if err := json.Unmarshal(req.Object.Raw, newVMI); err != nil {
		return invalid("", "%v", err)
	}
	if err := json.Unmarshal(req.OldObject.Raw, oldVMI); err != nil {
		return invalid("", "%v", err)
	}
	if equality.Semantic.DeepEqual(newVMI.Spec, oldVMI.Spec) {
		return nil
	}
	if msg := w.countVolumesAndDisks(newVMI); msg != "" {
		return invalidCause(msg)
	}
	statuses := oldVMI.Status.VolumeStatus
	newDisks, oldDisks := diskMap(newVMI.Spec.Domain.Devices.Disks), diskMap(oldVMI.Spec.Domain.Devices.Disks)
	if msg := verifyPermanentVolumes(permanentVolumes(newVMI.Spec.Volumes, statuses), permanentVolumes(oldVMI.Spec.Volumes, statuses), newDisks, oldDisks); msg != "" {
		return invalidCause(msg)
	}
	newHot, oldHot := hotplugVolumeMap(newVMI.Spec.Volumes, statuses), hotplugVolumeMap(oldVMI.Spec.Volumes, statuses)
	for _, name := range sortedKeys(newHot) {
		if c := w.verifyHotplugVolume(name, newHot[name], oldHot, newDisks, oldDisks); c != nil {
			return c
		}
	}
	return nil
}

// countVolumesAndDisks: every volume needs exactly one disk (v1.7.0
// storagehotplug.go:125 validateExpectedDisksAndFilesystems: a CD-ROM
// without a volume is fine when declarative hotplug is on; v1.5.3
// vmi-update-admitter.go:146-154).
func (w *webhooks) countVolumesAndDisks(vmi *kubevirtv1.VirtualMachineInstance) string {
	names := map[string]bool{}
	for _, v := range vmi.Spec.Volumes {
		if v.MemoryDump == nil {
			names[v.Name] = true
		}
	}
	fs := len(vmi.Spec.Domain.Devices.Filesystems)
	if w.c.feat.v15Messages {
		if have := len(vmi.Spec.Domain.Devices.Disks) + fs; have != len(names) {
			return fmt.Sprintf("number of disks and filesystems (%d) does not equal the number of volumes (%d)", have, len(names))
		}
		return ""
	}
	_, declarative := w.c.gates()
	required := fs
	for _, d := range vmi.Spec.Domain.Devices.Disks {
		if !names[d.Name] && d.CDRom != nil && declarative {
			continue
		}
		required++
	}
	if required != len(names) {
		return fmt.Sprintf("mismatch between volumes declared (%d) and required (%d)", len(names), required)
	}
	return ""
}

// verifyHotplugVolume checks one hotplug volume of the new spec: an old one
// must not change (nor its disk), a new one must be a claim with a disk of
// an allowed bus (v1.7.0 storagehotplug.go:151 verifyHotplugVolumes; v1.5.3
// vmi-update-admitter.go:182).
func (w *webhooks) verifyHotplugVolume(name string, v kubevirtv1.Volume, oldHot map[string]kubevirtv1.Volume, newDisks, oldDisks map[string]kubevirtv1.Disk) []metav1.StatusCause {
	v15 := w.c.feat.v15Messages
	if old, ok := oldHot[name]; ok {
		switch {
		case !equality.Semantic.DeepEqual(v, old):
			return invalidCause(fmt.Sprintf("hotplug volume %s, changed", name))
		case v.MemoryDump != nil:
			return nil
		}
		if _, ok := newDisks[name]; !ok {
			if v15 {
				return invalidCause(fmt.Sprintf("Volume %s doesn't have a matching disk", name))
			}
			return invalidCause(fmt.Sprintf("volume %s doesn't have a matching disk", name))
		}
		if !equality.Semantic.DeepEqual(newDisks[name], oldDisks[name]) {
			return invalidCause(fmt.Sprintf("hotplug disk %s, changed", name))
		}
		return nil
	}
	if v.DataVolume == nil && v.PersistentVolumeClaim == nil && v.MemoryDump == nil {
		return invalidCause(fmt.Sprintf("volume %s is not a PVC or DataVolume", name))
	}
	if v.MemoryDump != nil {
		return nil
	}
	disk, ok := newDisks[name]
	if !ok {
		if v15 {
			return invalidCause(fmt.Sprintf("Disk %s does not exist", name))
		}
		return invalidCause(fmt.Sprintf("disk %s does not exist", name))
	}
	if _, had := oldDisks[name]; had && !v15 {
		return nil
	}
	if v15 {
		// v1.5.3 vmi-update-admitter.go:234-259.
		switch {
		case disk.Disk == nil && disk.LUN == nil:
			return invalidCause(fmt.Sprintf("Disk %s requires diskDevice of type 'disk' or 'lun' to be hotplugged.", name))
		case (disk.Disk == nil || disk.Disk.Bus != kubevirtv1.DiskBusSCSI) && (disk.LUN == nil || disk.LUN.Bus != kubevirtv1.DiskBusSCSI):
			return invalidCause(fmt.Sprintf("hotplugged Disk %s does not use a scsi bus", name))
		}
		return nil
	}
	return w.validateHotplugDisk(&disk, name, "Hotplug configuration", "")
}

// verifyPermanentVolumes: the volumes that were there at boot must stay as
// they are (v1.7.0 storagehotplug.go:224).
func verifyPermanentVolumes(newPerm, oldPerm map[string]kubevirtv1.Volume, newDisks, oldDisks map[string]kubevirtv1.Disk) string {
	if len(newPerm) != len(oldPerm) {
		return "Number of permanent volumes has changed"
	}
	for _, name := range sortedKeys(newPerm) {
		old, ok := oldPerm[name]
		switch {
		case !ok:
			return fmt.Sprintf("permanent volume %s, not found", name)
		case !equality.Semantic.DeepEqual(newPerm[name], old):
			return fmt.Sprintf("permanent volume %s, changed", name)
		case !equality.Semantic.DeepEqual(newDisks[name], oldDisks[name]):
			return fmt.Sprintf("permanent disk %s, changed", name)
		}
	}
	return ""
}

// permanentVolumes are the volumes with a volumeStatus entry that is not a
// hotplug one; hotplugVolumeMap the others, new volumes included (v1.7.0
// storagehotplug.go getHotplugVolumes, getPermanentVolumes).
func permanentVolumes(vols []kubevirtv1.Volume, statuses []kubevirtv1.VolumeStatus) map[string]kubevirtv1.Volume {
	return splitVolumes(vols, statuses, true)
}

func hotplugVolumeMap(vols []kubevirtv1.Volume, statuses []kubevirtv1.VolumeStatus) map[string]kubevirtv1.Volume {
	return splitVolumes(vols, statuses, false)
}

func splitVolumes(vols []kubevirtv1.Volume, statuses []kubevirtv1.VolumeStatus, permanent bool) map[string]kubevirtv1.Volume {
	perm := map[string]bool{}
	for _, st := range statuses {
		if st.HotplugVolume == nil {
			perm[st.Name] = true
		}
	}
	out := map[string]kubevirtv1.Volume{}
	for _, v := range vols {
		if perm[v.Name] == permanent {
			out[v.Name] = v
		}
	}
	return out
}

func diskMap(disks []kubevirtv1.Disk) map[string]kubevirtv1.Disk {
	out := map[string]kubevirtv1.Disk{}
	for _, d := range disks {
		if d.Name != "" {
			out[d.Name] = d
		}
	}
	return out
}

// sortedKeys makes the first reported error deterministic (KubeVirt walks a
// map, so with several bad volumes it names any one of them).
func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

func invalidCause(msg string) []metav1.StatusCause {
	return []metav1.StatusCause{{Type: metav1.CauseTypeFieldValueInvalid, Message: msg}}
}
