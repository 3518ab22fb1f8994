package hotplug

import (
	"fmt"
	"slices"
	"strings"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

// observed is one VM's state as the informers last saw it. Either pointer may
// be nil: the VMI can outlive its VM and a stopped VM has no VMI.
type observed struct {
	vm  *kubevirtv1.VirtualMachine
	vmi *kubevirtv1.VirtualMachineInstance
}

func (o observed) gone() bool { return o.vm == nil && o.vmi == nil }

// inVMSpec reports whether the VM template has a volume of that name.
func (o observed) inVMSpec(volume string) bool {
	if o.vm == nil || o.vm.Spec.Template == nil {
		return false
	}
	for _, v := range o.vm.Spec.Template.Spec.Volumes {
		if v.Name == volume {
			return true
		}
	}
	return false
}

// diskInVMSpec reports whether the VM template has a disk of that name.
func (o observed) diskInVMSpec(volume string) bool {
	if o.vm == nil || o.vm.Spec.Template == nil {
		return false
	}
	for _, d := range o.vm.Spec.Template.Spec.Domain.Devices.Disks {
		if d.Name == volume {
			return true
		}
	}
	return false
}

// diskCount is how many disks the VM has or is getting: the larger of its
// template's disk and volume lists, with the queued add requests not in them
// yet.
func (o observed) diskCount() int {
	if o.vm == nil || o.vm.Spec.Template == nil {
		return 0
	}
	spec := o.vm.Spec.Template.Spec
	n := max(len(spec.Domain.Devices.Disks), len(spec.Volumes))
	for _, r := range o.vm.Status.VolumeRequests {
		if r.AddVolumeOptions != nil && !o.inVMSpec(r.AddVolumeOptions.Name) {
			n++
		}
	}
	return n
}

func (o observed) inVMISpec(volume string) bool {
	if o.vmi == nil {
		return false
	}
	for _, v := range o.vmi.Spec.Volumes {
		if v.Name == volume {
			return true
		}
	}
	return false
}

func (o observed) status(volume string) *kubevirtv1.VolumeStatus {
	if o.vmi == nil {
		return nil
	}
	for i := range o.vmi.Status.VolumeStatus {
		if o.vmi.Status.VolumeStatus[i].Name == volume {
			return &o.vmi.Status.VolumeStatus[i]
		}
	}
	return nil
}

// phase describes the VMI's entry for the volume for a person.
func (o observed) phase(volume string) string {
	switch s := o.status(volume); {
	case o.vmi == nil:
		return "no VMI"
	case s == nil && o.inVMISpec(volume):
		return "in the VMI spec, no status yet"
	case s == nil:
		return "not in the VMI"
	case s.Reason != "" || s.Message != "":
		return "VMI phase " + string(s.Phase) + ": " + s.Reason + " " + s.Message
	default:
		return "VMI phase " + string(s.Phase)
	}
}

// requested reports whether status.volumeRequests (legacy hotplug) holds an
// add or a remove for the volume that virt-controller has not processed yet.
func (o observed) requested(volume string) (add, remove bool) {
	if o.vm == nil {
		return false, false
	}
	for _, r := range o.vm.Status.VolumeRequests {
		if r.AddVolumeOptions != nil && r.AddVolumeOptions.Name == volume {
			add = true
		}
		if r.RemoveVolumeOptions != nil && r.RemoveVolumeOptions.Name == volume {
			remove = true
		}
	}
	return add, remove
}

// attached is the only test for a finished attach: volume and disk in the VM
// spec, no legacy removal queued for it, and the VMI reports the hotplug
// volume Ready with a target device.
func (o observed) attached(volume string) bool {
	if !o.inVMSpec(volume) || !o.diskInVMSpec(volume) {
		return false
	}
	if _, removing := o.requested(volume); removing {
		return false // going away: the legacy controller has not applied it yet
	}
	s := o.status(volume)
	return s != nil && s.HotplugVolume != nil && s.Phase == kubevirtv1.VolumeReady && s.Target != ""
}

// detached is the only test for a finished detach: no trace of the volume in
// the VM spec, the VMI spec, the VMI volume status or a pending add request.
func (o observed) detached(volume string) bool {
	add, _ := o.requested(volume)
	return !add && !o.inVMSpec(volume) && !o.inVMISpec(volume) && o.status(volume) == nil
}

// settling reports whether KubeVirt is still working on the VM's hotplug set:
// a legacy request is queued, or a hotplug volume is between phases. Changing
// the set while it settles makes KubeVirt replace its single attachment pod
// again, and changes faster than a pod start livelock it (kubevirt 16937).
func (o observed) settling() bool {
	return len(o.unsettled()) > 0
}

// unsettled names the volumes KubeVirt is still carrying a change for on the
// VM: queued legacy requests (unless the VM's updates are failing, when they
// do not move) and hotplug entries of a running VMI on their way in or out.
func (o observed) unsettled() []string {
	var vols []string
	if o.vm != nil && !failing(o.vm) {
		for _, r := range o.vm.Status.VolumeRequests {
			switch {
			case r.AddVolumeOptions != nil:
				vols = append(vols, r.AddVolumeOptions.Name)
			case r.RemoveVolumeOptions != nil:
				vols = append(vols, r.RemoveVolumeOptions.Name)
			}
		}
	}
	if o.vmi == nil || o.vmi.Status.Phase != kubevirtv1.Running {
		return vols
	}
	for _, s := range o.vmi.Status.VolumeStatus {
		if s.HotplugVolume == nil {
			continue
		}
		switch s.Phase {
		case kubevirtv1.VolumeReady:
			if s.Target == "" {
				vols = append(vols, s.Name)
			}
		case kubevirtv1.VolumePending:
			// A claim that is missing or not bound does not move by itself;
			// holding every other volume for it would starve the VM.
		default:
			vols = append(vols, s.Name)
		}
	}
	return vols
}

// inFlight describes, for the log of a hold, what the VM's changes wait
// behind: each volume KubeVirt is still carrying a change for, as
// volume:add|remove:phase (queued: a legacy request not taken yet;
// pod-started: its attachment pod runs), and this process's writes the
// informers do not show yet (volume:ours-attach|ours-detach).
func (o observed) inFlight(expect map[string]expectation) []string {
	var out []string
	for _, vol := range o.unsettled() {
		dir := "add"
		if addReq, removeReq := o.requested(vol); removeReq || !addReq && !o.inVMSpec(vol) {
			dir = "remove"
		}
		phase := "queued"
		if s := o.status(vol); s != nil {
			phase = string(s.Phase)
			if s.HotplugVolume != nil && s.HotplugVolume.AttachPodUID != "" {
				phase += "/pod-started"
			}
		}
		out = append(out, vol+":"+dir+":"+phase)
	}
	for _, vol := range sortedKeys(expect) {
		out = append(out, vol+":ours-"+expect[vol].op.String())
	}
	return out
}

// podStarting says KubeVirt waits for an attachment pod it created to start:
// an entry of a volume in the VMI spec names its pod but no UID, which
// virt-controller writes only once the pod's container is ready (kubevirt
// v1.7.0 pkg/virt-controller/watch/vmi/storage.go:197-204). Until then the
// host schedules the pod, attaches its volumes and starts it, none of which
// the VMI shows.
func (o observed) podStarting() bool {
	if o.vmi == nil || o.vmi.Status.Phase != kubevirtv1.Running {
		return false
	}
	for _, s := range o.vmi.Status.VolumeStatus {
		if s.HotplugVolume != nil && s.HotplugVolume.AttachPodName != "" && s.HotplugVolume.AttachPodUID == "" && o.inVMISpec(s.Name) {
			return true
		}
	}
	return false
}

// progressMark fingerprints KubeVirt's hotplug work on the VM: the phase of
// every hotplug volume, whether its attachment pod runs, and the queued
// legacy requests. It changes whenever KubeVirt moves.
func (o observed) progressMark() string {
	var b strings.Builder
	if o.vm != nil {
		fmt.Fprintf(&b, "requests=%d;", len(o.vm.Status.VolumeRequests))
	}
	if o.vmi != nil {
		for _, s := range o.vmi.Status.VolumeStatus {
			if s.HotplugVolume != nil {
				fmt.Fprintf(&b, "%s=%s/%t/%t;", s.Name, s.Phase, s.Target != "", s.HotplugVolume.AttachPodUID != "")
			}
		}
	}
	return b.String()
}

// claims lists the volumes (by claim name) a VM holds or is about to hold:
// hotplug and regular PVC volumes of the template and queued add requests.
func vmClaims(vm *kubevirtv1.VirtualMachine) []string {
	var out []string
	if vm.Spec.Template != nil {
		out = appendClaims(out, vm.Spec.Template.Spec.Volumes)
	}
	for _, r := range vm.Status.VolumeRequests {
		if a := r.AddVolumeOptions; a != nil && a.VolumeSource != nil && a.VolumeSource.PersistentVolumeClaim != nil {
			out = append(out, a.VolumeSource.PersistentVolumeClaim.ClaimName)
		}
	}
	return out
}

// vmiClaims lists the claims a VMI uses or is still releasing.
func vmiClaims(vmi *kubevirtv1.VirtualMachineInstance) []string {
	out := appendClaims(nil, vmi.Spec.Volumes)
	for _, s := range vmi.Status.VolumeStatus {
		if s.PersistentVolumeClaimInfo != nil && s.PersistentVolumeClaimInfo.ClaimName != "" {
			out = append(out, s.PersistentVolumeClaimInfo.ClaimName)
		} else {
			out = append(out, s.Name)
		}
	}
	return out
}

func appendClaims(out []string, vols []kubevirtv1.Volume) []string {
	for _, v := range vols {
		switch {
		case v.PersistentVolumeClaim != nil:
			out = append(out, v.PersistentVolumeClaim.ClaimName)
		case v.DataVolume != nil:
			out = append(out, v.DataVolume.Name)
		}
	}
	return out
}

// holdState describes how a VM holds a claim, for FailedPrecondition messages.
func (o observed) holdState(claim string) string {
	switch {
	case o.vm != nil && slices.Contains(vmClaims(o.vm), claim) && o.vmi != nil && slices.Contains(vmiClaims(o.vmi), claim):
		if s := o.status(claim); s != nil && s.Phase != kubevirtv1.VolumeReady {
			return "attaching"
		}
		return "attached"
	case o.vm != nil && slices.Contains(vmClaims(o.vm), claim):
		return "attaching"
	case o.vmi != nil && slices.Contains(vmiClaims(o.vmi), claim):
		return "still detaching"
	}
	return ""
}

// failing reports whether virt-controller's last pass over the VM failed:
// its queued requests then do not move until something changes.
// deviceMayBeGone says the VMI is paused on an I/O error: a disk of it
// lost its device under its attachment pod (a Longhorn volume faulted or
// detached), the trigger of virt-handler's remount deadlock
// (Strategy.OneRemovalAtATime). virt-handler writes the condition (kubevirt
// v1.7.0 pkg/virt-handler/vm.go:1161-1170).
func (o observed) deviceMayBeGone() bool {
	if o.vmi == nil {
		return false
	}
	for _, c := range o.vmi.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineInstancePaused && c.Status == "True" && c.Reason == "PausedIOError" {
			return true
		}
	}
	return false
}

func failing(vm *kubevirtv1.VirtualMachine) bool {
	for _, c := range vm.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineFailure && c.Status == "True" {
			return true
		}
	}
	return false
}

// onlyInVMI reports whether the VMI spec holds the volume while its VM has
// neither the volume nor a request for it: a legacy pass that reached one
// of the two only (plan.go says which), which KubeVirt never repairs.
func (o observed) onlyInVMI(volume string) bool {
	if o.vm == nil || o.inVMSpec(volume) || !o.inVMISpec(volume) {
		return false
	}
	add, remove := o.requested(volume)
	return !add && !remove
}

// unplugging reports whether the VMI's entry for volume is on its way out
// (KubeVirt writes these phases only for a volume gone from the VMI spec).
func (o observed) unplugging(volume string) bool {
	s := o.status(volume)
	return s != nil && (s.Phase == kubevirtv1.HotplugVolumeUnMounted || s.Phase == kubevirtv1.HotplugVolumeDetaching)
}
