// Package diagnose cross-checks what the guest cluster believes is attached
// (its VolumeAttachments) against what KubeVirt holds on the host (VM specs,
// queued legacy requests, VMI volume status), and what the driver's hotplug
// queue is waiting for, and names every disagreement. It reads; it never
// changes anything.
package diagnose

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// Kinds of findings.
const (
	// GhostAttachment: a VM holds a volume of this driver that no guest
	// VolumeAttachment wants on that VM, and the driver is not detaching it.
	GhostAttachment = "ghost-attachment"
	// LostAttachment: a VolumeAttachment says attached, but the VM's VMI does
	// not have the volume Ready (harvester 10588: pods then wait forever).
	LostAttachment = "attached-but-lost"
	// TwoHolders: one volume is held by more than one VM.
	TwoHolders = "held-by-two-vms"
	// StuckRequests: legacy add/remove requests queued on a VM whose last
	// update failed: KubeVirt retries the same failing update and every
	// request behind it waits.
	StuckRequests = "stuck-volume-requests"
	// SpecVMIDrift: the VM spec and its running VMI disagree about a volume
	// and nothing is queued that would reconcile them.
	SpecVMIDrift = "vm-vmi-drift"
	// NotReady: a VMI volume status entry is not Ready.
	NotReady = "volume-not-ready"
	// StuckVolumeAttachment: a VolumeAttachment being deleted or with an
	// attach or detach error.
	StuckVolumeAttachment = "volumeattachment-error"
	// SlowIntent: the driver's queue has waited long on a volume.
	SlowIntent = "slow-intent"
	// FailingVM: the driver's attempts at the host for a VM are failing.
	FailingVM = "host-refuses"
)

// Finding is one disagreement.
type Finding struct {
	Kind   string
	Volume string
	VM     string
	// Node is the guest node, where one is involved.
	Node   string
	Detail string
}

func (f Finding) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-24s", f.Kind)
	if f.Volume != "" {
		fmt.Fprintf(&b, " volume=%s", f.Volume)
	}
	if f.VM != "" {
		fmt.Fprintf(&b, " vm=%s", f.VM)
	}
	if f.Node != "" {
		fmt.Fprintf(&b, " node=%s", f.Node)
	}
	return b.String() + ": " + f.Detail
}

// Input is everything Check looks at.
type Input struct {
	// Driver is the CSI driver name whose VolumeAttachments count.
	Driver string
	// Guest side (empty when the guest cluster is not reachable).
	VolumeAttachments []storagev1.VolumeAttachment
	PersistentVolumes []corev1.PersistentVolume
	CSINodes          []storagev1.CSINode
	// Host side, the namespace of the guest's VMs.
	VMs  []kubevirtv1.VirtualMachine
	VMIs []kubevirtv1.VirtualMachineInstance
	// Queue is the controller's hotplug state, if it could be read.
	Queue []hotplug.VMState
	// Now and SlowAfter judge the queue's waits.
	Now       time.Time
	SlowAfter time.Duration
}

// hold is how a VM holds a volume.
type hold struct {
	inSpec, addQueued, removeQueued, inVMISpec bool
	status                                     *kubevirtv1.VolumeStatus
}

// Check names every disagreement in in, sorted by volume, VM and kind.
func Check(in Input) []Finding {
	var out []Finding
	add := func(f Finding) { out = append(out, f) }

	holds := map[string]map[string]*hold{} // volume -> VM -> hold
	get := func(vol, vm string) *hold {
		if holds[vol] == nil {
			holds[vol] = map[string]*hold{}
		}
		if holds[vol][vm] == nil {
			holds[vol][vm] = &hold{}
		}
		return holds[vol][vm]
	}
	vmis := map[string]*kubevirtv1.VirtualMachineInstance{}
	for i := range in.VMIs {
		vmi := &in.VMIs[i]
		vmis[vmi.Name] = vmi
		for _, v := range vmi.Spec.Volumes {
			if isHotplugClaim(v) {
				get(v.Name, vmi.Name).inVMISpec = true
			}
		}
		for i := range vmi.Status.VolumeStatus {
			st := &vmi.Status.VolumeStatus[i]
			if st.HotplugVolume != nil {
				get(st.Name, vmi.Name).status = st
			}
		}
	}
	for _, vm := range in.VMs {
		if vm.Spec.Template != nil {
			for _, v := range vm.Spec.Template.Spec.Volumes {
				if isHotplugClaim(v) {
					get(v.Name, vm.Name).inSpec = true
				}
			}
		}
		var reqs []string
		for _, r := range vm.Status.VolumeRequests {
			switch {
			case r.AddVolumeOptions != nil:
				get(r.AddVolumeOptions.Name, vm.Name).addQueued = true
				reqs = append(reqs, "add "+r.AddVolumeOptions.Name)
			case r.RemoveVolumeOptions != nil:
				get(r.RemoveVolumeOptions.Name, vm.Name).removeQueued = true
				reqs = append(reqs, "remove "+r.RemoveVolumeOptions.Name)
			}
		}
		if len(reqs) > 0 {
			if msg := failure(&vm); msg != "" {
				add(Finding{Kind: StuckRequests, VM: vm.Name, Detail: fmt.Sprintf("%d request(s) queued (%s) behind a failing update: %s",
					len(reqs), strings.Join(reqs, ", "), msg)})
			}
		}
	}

	// What the guest wants: volume -> VM it is attached (or attaching) to.
	vmOfNode := map[string]string{}
	for _, n := range in.CSINodes {
		for _, d := range n.Spec.Drivers {
			if d.Name == in.Driver && d.NodeID != "" {
				vmOfNode[n.Name] = d.NodeID
			}
		}
	}
	handleOfPV := map[string]string{}
	for _, pv := range in.PersistentVolumes {
		if pv.Spec.CSI != nil && pv.Spec.CSI.Driver == in.Driver {
			handleOfPV[pv.Name] = pv.Spec.CSI.VolumeHandle
		}
	}
	wanted := map[string]map[string]bool{} // volume -> VM
	for _, va := range in.VolumeAttachments {
		if va.Spec.Attacher != in.Driver || va.Spec.Source.PersistentVolumeName == nil {
			continue
		}
		vol := handleOfPV[*va.Spec.Source.PersistentVolumeName]
		if vol == "" {
			vol = *va.Spec.Source.PersistentVolumeName
		}
		vm := vmOfNode[va.Spec.NodeName]
		if vm == "" {
			vm = va.Spec.NodeName
		}
		if va.DeletionTimestamp == nil {
			if wanted[vol] == nil {
				wanted[vol] = map[string]bool{}
			}
			wanted[vol][vm] = true
		}
		switch {
		case va.Status.AttachError != nil:
			add(Finding{Kind: StuckVolumeAttachment, Volume: vol, VM: vm, Node: va.Spec.NodeName,
				Detail: fmt.Sprintf("VolumeAttachment %s: attach error: %s", va.Name, va.Status.AttachError.Message)})
		case va.Status.DetachError != nil:
			add(Finding{Kind: StuckVolumeAttachment, Volume: vol, VM: vm, Node: va.Spec.NodeName,
				Detail: fmt.Sprintf("VolumeAttachment %s: detach error: %s", va.Name, va.Status.DetachError.Message)})
		case va.DeletionTimestamp != nil && in.Now.Sub(va.DeletionTimestamp.Time) > in.SlowAfter:
			add(Finding{Kind: StuckVolumeAttachment, Volume: vol, VM: vm, Node: va.Spec.NodeName,
				Detail: fmt.Sprintf("VolumeAttachment %s has been detaching for %s", va.Name, in.Now.Sub(va.DeletionTimestamp.Time).Round(time.Second))})
		}
		if va.Status.Attached && va.DeletionTimestamp == nil {
			h := holds[vol][vm]
			if h == nil || h.status == nil || h.status.Phase != kubevirtv1.VolumeReady || h.status.Target == "" {
				add(Finding{Kind: LostAttachment, Volume: vol, VM: vm, Node: va.Spec.NodeName,
					Detail: fmt.Sprintf("VolumeAttachment %s says attached, but the VMI shows %s", va.Name, describe(h, vmis[vm]))})
			}
		}
	}

	// What the driver is doing.
	pending := map[string]map[string]hotplug.Op{} // volume -> VM -> op
	for _, st := range in.Queue {
		if st.LastError != "" {
			add(Finding{Kind: FailingVM, VM: st.VM, Detail: fmt.Sprintf("attempts failing since %s: %s",
				st.FailingSince.UTC().Format(time.RFC3339), st.LastError)})
		}
		for _, it := range st.Intents {
			if pending[it.Volume] == nil {
				pending[it.Volume] = map[string]hotplug.Op{}
			}
			pending[it.Volume][st.VM] = it.Op
			if it.WaitingFor != "" && in.Now.Sub(it.WaitingSince) >= in.SlowAfter {
				add(Finding{Kind: SlowIntent, Volume: it.Volume, VM: st.VM, Detail: fmt.Sprintf("%s %s for %s",
					it.Op, it.WaitingFor, in.Now.Sub(it.WaitingSince).Round(time.Second))})
			}
		}
	}

	for _, vol := range sortedKeys(holds) {
		var holders []string
		for _, vm := range sortedKeys(holds[vol]) {
			h := holds[vol][vm]
			holders = append(holders, vm)
			vmi := vmis[vm]
			if h.status != nil && h.status.Phase != kubevirtv1.VolumeReady {
				add(Finding{Kind: NotReady, Volume: vol, VM: vm, Detail: describe(h, vmi)})
			}
			running := vmi != nil && vmi.Status.Phase == kubevirtv1.Running
			switch {
			case h.inSpec && running && !h.inVMISpec && !h.addQueued && !h.removeQueued:
				add(Finding{Kind: SpecVMIDrift, Volume: vol, VM: vm, Detail: "in the VM spec but not in its running VMI"})
			case !h.inSpec && h.inVMISpec && !h.addQueued && !h.removeQueued && (h.status == nil || h.status.Phase != kubevirtv1.HotplugVolumeDetaching):
				add(Finding{Kind: SpecVMIDrift, Volume: vol, VM: vm, Detail: "in the VMI but not in its VM's spec"})
			}
			if in.VolumeAttachments != nil && (h.inSpec || h.inVMISpec || h.addQueued) && !wanted[vol][vm] {
				if op, ok := pending[vol][vm]; !ok || op != hotplug.Detach {
					add(Finding{Kind: GhostAttachment, Volume: vol, VM: vm, Detail: "held by the VM (" + describe(h, vmi) + ") but no guest VolumeAttachment wants it there"})
				}
			}
		}
		if len(holders) > 1 {
			add(Finding{Kind: TwoHolders, Volume: vol, Detail: "held by " + strings.Join(holders, ", ")})
		}
	}
	slices.SortStableFunc(out, func(a, b Finding) int {
		return cmp.Or(cmp.Compare(a.Volume, b.Volume), cmp.Compare(a.VM, b.VM), cmp.Compare(a.Kind, b.Kind))
	})
	return out
}

// isHotplugClaim reports a hot-plugged PVC volume named after its claim, as
// this driver (and upstream) name them.
func isHotplugClaim(v kubevirtv1.Volume) bool {
	c := v.PersistentVolumeClaim
	return c != nil && c.Hotpluggable && c.ClaimName == v.Name
}

func describe(h *hold, vmi *kubevirtv1.VirtualMachineInstance) string {
	switch {
	case vmi == nil:
		return "no VMI"
	case h == nil || h.status == nil:
		return "no volume status for it"
	}
	s := "phase " + string(h.status.Phase)
	if h.status.Reason != "" || h.status.Message != "" {
		s += " (" + strings.TrimSpace(h.status.Reason+" "+h.status.Message) + ")"
	}
	if h.status.Phase == kubevirtv1.VolumeReady && h.status.Target == "" {
		s += " without a target"
	}
	return s
}

func failure(vm *kubevirtv1.VirtualMachine) string {
	for _, c := range vm.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineFailure && c.Status == corev1.ConditionTrue {
			return strings.TrimSpace(c.Reason + ": " + c.Message)
		}
	}
	return ""
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
