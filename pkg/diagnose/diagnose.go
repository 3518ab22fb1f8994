// Package diagnose cross-checks what the guest cluster believes is attached
// (its VolumeAttachments) against what KubeVirt holds on the host (VM specs,
// queued legacy requests, VMI volume status), and what the driver's hotplug
// queue is waiting for, and names every disagreement; on the host side it
// also looks at the guest volumes' host PVCs, KubeVirt's attachment pods,
// the node IDs of the guest's CSINodes and the guest Nodes' volumesInUse. It
// reads; it never changes anything.
package diagnose

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// Kinds of findings.
const (
	// GhostAttachment: a VM holds a volume of this driver that the guest's
	// VolumeAttachments want on another VM, and the driver is not detaching
	// it.
	GhostAttachment = "ghost-attachment"
	// InVMWithoutAttachment: a VM that is a node of this guest cluster holds
	// a volume of this guest cluster (one of its PVs of this driver names
	// it) that no guest VolumeAttachment asks for at all (an orphaned
	// hot-plug), and the driver is not detaching it.
	InVMWithoutAttachment = "in-vm-without-attachment"
	// LostAttachment: a VolumeAttachment of a hot-plugged volume says
	// attached, but the VM's VMI does not have the volume Ready (harvester
	// 10588: pods then wait forever).
	LostAttachment = "attached-but-lost"
	// RWXExportNotEnabled: a VolumeAttachment of a ReadWriteMany volume says
	// attached, but the volume's NetworkFilesystem export is not serving.
	RWXExportNotEnabled = "rwx-export-not-enabled"
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
	// NodePluginNotRegistered (informational): a guest Node with
	// VolumeAttachments of hot-plugged volumes whose CSINode has no node ID
	// of this driver (the node plugin is not registered, e.g. restarting),
	// and whose providerID and name name no VM of the namespace either: its
	// attachments are not judged.
	NodePluginNotRegistered = "node-plugin-not-registered"
	// HostClaimMissing: a guest PV of this driver whose host PVC (its volume
	// handle) does not exist in the host namespace.
	HostClaimMissing = "host-pvc-missing"
	// HostClaimPending: a guest PV's host PVC has been Pending for long: the
	// driver never hot-plugs it.
	HostClaimPending = "host-pvc-pending"
	// HostClaimLost: a guest PV's host PVC is Lost (its host PV is gone).
	HostClaimLost = "host-pvc-lost"
	// AttachmentPodPending: one of KubeVirt's attachment pods (hp-volume-*)
	// has been Pending for long; every hotplug of its VM waits for it.
	AttachmentPodPending = "attachment-pod-pending"
	// CSINodeUnknownVM: a guest CSINode gives this driver a node ID that
	// names no VM of the host namespace: every publish to that Node fails.
	CSINodeUnknownVM = "csinode-names-no-vm"
	// InUseNotInVM (informational): a guest Node lists a volume in
	// status.volumesInUse that its VM does not hold, and no live
	// VolumeAttachment of the volume on that Node explains it.
	InUseNotInVM = "in-use-not-in-vm"
)

// Finding is one disagreement.
type Finding struct {
	Kind   string
	Volume string
	VM     string
	// Node is the guest node, where one is involved.
	Node   string
	Detail string
	// Info marks a state worth knowing that is not a disagreement: it does
	// not count towards diagnose's exit code.
	Info bool
}

func (f Finding) String() string {
	var b strings.Builder
	if f.Info {
		b.WriteString("info: ")
	}
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
	// Namespace is the host namespace of the guest's VMs, for the report.
	Namespace string
	// GuestRead says the guest side below was read; without it the checks
	// that need the guest's view are left out. (A guest without any
	// VolumeAttachment is read and has an empty list.)
	GuestRead         bool
	VolumeAttachments []storagev1.VolumeAttachment
	PersistentVolumes []corev1.PersistentVolume
	CSINodes          []storagev1.CSINode
	Nodes             []corev1.Node
	// Host side, the namespace of the guest's VMs.
	VMs  []kubevirtv1.VirtualMachine
	VMIs []kubevirtv1.VirtualMachineInstance
	// HostClaims are the namespace's PVCs: a volume's Longhorn volume, whose
	// NetworkFilesystem exports a ReadWriteMany volume.
	HostClaims []corev1.PersistentVolumeClaim
	// NetworkFilesystems are Harvester's NFS exports; NetworkFSRead says
	// they could be read (else ReadWriteMany attachments are not judged).
	NetworkFilesystems []host.NetworkFS
	NetworkFSRead      bool
	// HostPods are the namespace's attachment and virt-launcher pods;
	// HostPodsRead says they could be read.
	HostPods     []corev1.Pod
	HostPodsRead bool
	// HostStorage is what the host storage path says about each held volume (hoststorage.go).
	HostStorage map[string][]host.StorageIssue
	// Queue is the controller's hotplug state, if it could be read, and
	// QueueSource which replica (or replicas) it was read from.
	Queue       []hotplug.VMState
	QueueSource string
	// Now and SlowAfter judge the queue's waits.
	Now       time.Time
	SlowAfter time.Duration
	// Notes say what was not looked at and why; Report prints them.
	Notes []string
}

// Check names every disagreement in in, sorted by volume, VM and kind: each
// VM's queued requests, each guest VolumeAttachment, the driver's queue,
// each volume a VM holds, and the host side of the guest's volumes and
// nodes (host PVCs, attachment pods, CSINode node IDs, volumesInUse).
func Check(in Input) []Finding {
	v := look(in)
	var r report
	v.judgeRequests(&r)
	v.judgeAttachments(&r)
	v.judgeQueue(&r)
	v.judgeWedges(&r)
	v.judgeHolds(&r)
	v.judgeHostClaims(&r)
	v.judgeAttachmentPods(&r)
	v.judgeCSINodes(&r)
	v.judgeVolumesInUse(&r)
	v.judgeHostStorage(&r)
	return r.sorted()
}

type report struct{ out []Finding }

func (r *report) add(f Finding) { r.out = append(r.out, f) }

func (r *report) sorted() []Finding {
	slices.SortStableFunc(r.out, func(a, b Finding) int {
		return cmp.Or(cmp.Compare(a.Volume, b.Volume), cmp.Compare(a.VM, b.VM), cmp.Compare(a.Kind, b.Kind), cmp.Compare(a.Node, b.Node))
	})
	return r.out
}

// hold is how a VM holds a volume.
type hold struct {
	inSpec, addQueued, removeQueued, inVMISpec bool
	status                                     *kubevirtv1.VolumeStatus
}

// held says the VM has the volume or is about to, and no removal is queued
// (a stuck one is reported as stuck-volume-requests): what the guest must
// want there.
func (h *hold) held() bool { return (h.inSpec || h.inVMISpec || h.addQueued) && !h.removeQueued }

// attachment is one guest VolumeAttachment of this driver, resolved.
type attachment struct {
	va  *storagev1.VolumeAttachment
	vol string
	// vm is the VM of the attachment's Node, "" when it cannot be told.
	vm string
	// rwx: a ReadWriteMany volume, served over NFS, never hot-plugged.
	rwx bool
}

func (a attachment) deleting() bool { return a.va.DeletionTimestamp != nil }

// view is Input indexed for the judgements; building it decides nothing.
type view struct {
	in    Input
	holds map[string]map[string]*hold // volume -> VM -> hold
	vmis  map[string]*kubevirtv1.VirtualMachineInstance
	nodes nodeMap
	// attachments are the guest's, and what they ask for per volume: wanted
	// on a VM (not being deleted), detaching from one, asked for at all, and
	// asked for on a Node whose VM is unknown.
	attachments []attachment
	wanted      map[string]map[string]bool
	detaching   map[string]map[string]bool
	asked       map[string]bool
	unmapped    map[string]bool
	pending     map[string]map[string]hotplug.Op // volume -> VM -> the driver's intent
	claims      map[string]*corev1.PersistentVolumeClaim
	exports     map[string]*host.NetworkFS // by name: the Longhorn volume's
	// pvs are the guest PVs of this driver by volume handle.
	pvs map[string]*corev1.PersistentVolume
}

func look(in Input) *view {
	v := &view{in: in, holds: map[string]map[string]*hold{}, vmis: map[string]*kubevirtv1.VirtualMachineInstance{},
		nodes: mapNodes(in), wanted: map[string]map[string]bool{}, detaching: map[string]map[string]bool{},
		asked: map[string]bool{}, unmapped: map[string]bool{}, pending: map[string]map[string]hotplug.Op{},
		claims: map[string]*corev1.PersistentVolumeClaim{}, exports: map[string]*host.NetworkFS{}, pvs: map[string]*corev1.PersistentVolume{}}
	v.lookAtHost()
	v.lookAtGuest()
	for _, st := range in.Queue {
		for _, it := range st.Intents {
			setIn(v.pending, it.Volume, st.VM, it.Op)
		}
	}
	return v
}

func (v *view) holdOf(vol, vm string) *hold {
	if v.holds[vol] == nil {
		v.holds[vol] = map[string]*hold{}
	}
	if v.holds[vol][vm] == nil {
		v.holds[vol][vm] = &hold{}
	}
	return v.holds[vol][vm]
}

func (v *view) lookAtHost() {
	for i := range v.in.VMIs {
		vmi := &v.in.VMIs[i]
		v.vmis[vmi.Name] = vmi
		for _, vol := range vmi.Spec.Volumes {
			if isHotplugClaim(vol) {
				v.holdOf(vol.Name, vmi.Name).inVMISpec = true
			}
		}
		for i := range vmi.Status.VolumeStatus {
			st := &vmi.Status.VolumeStatus[i]
			if st.HotplugVolume != nil {
				v.holdOf(st.Name, vmi.Name).status = st
			}
		}
	}
	for _, vm := range v.in.VMs {
		if vm.Spec.Template != nil {
			for _, vol := range vm.Spec.Template.Spec.Volumes {
				if isHotplugClaim(vol) {
					v.holdOf(vol.Name, vm.Name).inSpec = true
				}
			}
		}
		for _, r := range vm.Status.VolumeRequests {
			switch {
			case r.AddVolumeOptions != nil:
				v.holdOf(r.AddVolumeOptions.Name, vm.Name).addQueued = true
			case r.RemoveVolumeOptions != nil:
				v.holdOf(r.RemoveVolumeOptions.Name, vm.Name).removeQueued = true
			}
		}
	}
	for i := range v.in.HostClaims {
		v.claims[v.in.HostClaims[i].Name] = &v.in.HostClaims[i]
	}
	for i := range v.in.NetworkFilesystems {
		v.exports[v.in.NetworkFilesystems[i].Name] = &v.in.NetworkFilesystems[i]
	}
}

func (v *view) lookAtGuest() {
	pvs := map[string]*corev1.PersistentVolume{}
	for i := range v.in.PersistentVolumes {
		pv := &v.in.PersistentVolumes[i]
		if pv.Spec.CSI != nil && pv.Spec.CSI.Driver == v.in.Driver {
			pvs[pv.Name] = pv
			v.pvs[pv.Spec.CSI.VolumeHandle] = pv
		}
	}
	for i := range v.in.VolumeAttachments {
		va := &v.in.VolumeAttachments[i]
		if va.Spec.Attacher != v.in.Driver || va.Spec.Source.PersistentVolumeName == nil {
			continue
		}
		a := attachment{va: va, vol: *va.Spec.Source.PersistentVolumeName, vm: v.nodes.vm[va.Spec.NodeName]}
		pv := pvs[a.vol]
		if pv != nil {
			a.vol = pv.Spec.CSI.VolumeHandle
		}
		a.rwx = v.isRWX(a.vol, pv)
		v.attachments = append(v.attachments, a)
		switch {
		case a.rwx:
			continue // nothing of it is in a VM
		case a.vm == "":
			v.unmapped[a.vol] = true
		case a.deleting():
			setIn(v.detaching, a.vol, a.vm, true)
		default:
			setIn(v.wanted, a.vol, a.vm, true)
		}
		v.asked[a.vol] = true
	}
}

// isRWX tells a volume served over NFS from a hot-plugged one as the
// external-attacher does, by the guest PV's access modes (ReadWriteMany
// becomes MULTI_NODE_MULTI_WRITER, which the driver serves through a
// NetworkFilesystem); without a guest PV, by the host: the volume's Longhorn
// volume has a NetworkFilesystem. A VM's disks never say it: an RWX volume
// is in no VM.
func (v *view) isRWX(vol string, pv *corev1.PersistentVolume) bool {
	if pv != nil {
		return slices.Contains(pv.Spec.AccessModes, corev1.ReadWriteMany)
	}
	pvc := v.claims[vol]
	return pvc != nil && pvc.Spec.VolumeName != "" && v.exports[pvc.Spec.VolumeName] != nil
}

func (v *view) judgeRequests(r *report) {
	for i := range v.in.VMs {
		vm := &v.in.VMs[i]
		var reqs []string
		for _, rq := range vm.Status.VolumeRequests {
			switch {
			case rq.AddVolumeOptions != nil:
				reqs = append(reqs, "add "+rq.AddVolumeOptions.Name)
			case rq.RemoveVolumeOptions != nil:
				reqs = append(reqs, "remove "+rq.RemoveVolumeOptions.Name)
			}
		}
		if msg := failure(vm); len(reqs) > 0 && msg != "" {
			r.add(Finding{Kind: StuckRequests, VM: vm.Name, Detail: fmt.Sprintf("%d request(s) queued (%s) behind a failing update: %s",
				len(reqs), strings.Join(reqs, ", "), msg)})
		}
	}
}

// judgeAttachments judges each guest VolumeAttachment: its own errors, then,
// once attached, whether what it says holds on the host: the export of a
// ReadWriteMany volume, the VMI entry of a hot-plugged one.
func (v *view) judgeAttachments(r *report) {
	unjudged := map[string][]string{} // Node -> VolumeAttachments
	for _, a := range v.attachments {
		v.judgeAttachmentErrors(r, a)
		switch {
		case !a.va.Status.Attached || a.deleting():
		case a.rwx:
			v.judgeExport(r, a)
		case a.vm == "":
			unjudged[a.va.Spec.NodeName] = append(unjudged[a.va.Spec.NodeName], a.va.Name)
		default:
			v.judgeHotplugged(r, a)
		}
	}
	for _, node := range sortedKeys(unjudged) {
		r.add(Finding{Kind: NodePluginNotRegistered, Node: node, Info: true, Detail: fmt.Sprintf(
			"its CSINode has no node ID of %s and neither its providerID nor its name names a VM of the namespace; VolumeAttachments not judged: %s",
			v.in.Driver, strings.Join(unjudged[node], ", "))})
	}
}

func (v *view) judgeAttachmentErrors(r *report, a attachment) {
	f := Finding{Kind: StuckVolumeAttachment, Volume: a.vol, VM: a.vm, Node: a.va.Spec.NodeName}
	switch st := a.va.Status; {
	case st.AttachError != nil:
		f.Detail = fmt.Sprintf("VolumeAttachment %s: attach error: %s", a.va.Name, st.AttachError.Message)
	case st.DetachError != nil:
		f.Detail = fmt.Sprintf("VolumeAttachment %s: detach error: %s", a.va.Name, st.DetachError.Message)
	case a.deleting() && v.in.Now.Sub(a.va.DeletionTimestamp.Time) > v.in.SlowAfter:
		f.Detail = fmt.Sprintf("VolumeAttachment %s has been detaching for %s", a.va.Name, v.in.Now.Sub(a.va.DeletionTimestamp.Time).Round(time.Second))
	default:
		return
	}
	r.add(f)
}

func (v *view) judgeHotplugged(r *report, a attachment) {
	h := v.holds[a.vol][a.vm]
	if h == nil || h.status == nil || h.status.Phase != kubevirtv1.VolumeReady || h.status.Target == "" {
		r.add(Finding{Kind: LostAttachment, Volume: a.vol, VM: a.vm, Node: a.va.Spec.NodeName,
			Detail: fmt.Sprintf("VolumeAttachment %s says attached, but the VMI shows %s", a.va.Name, describe(h, v.vmis[a.vm]))})
	}
}

// judgeExport: an attached ReadWriteMany volume is healthy while its
// NetworkFilesystem serves; nodes mount that export, no VM is involved.
func (v *view) judgeExport(r *report, a attachment) {
	if !v.in.NetworkFSRead {
		return
	}
	if why := v.exportProblem(a.vol); why != "" {
		r.add(Finding{Kind: RWXExportNotEnabled, Volume: a.vol, VM: a.vm, Node: a.va.Spec.NodeName,
			Detail: fmt.Sprintf("VolumeAttachment %s of a ReadWriteMany volume says attached, but %s", a.va.Name, why)})
	}
}

func (v *view) exportProblem(vol string) string {
	pvc := v.claims[vol]
	switch {
	case pvc == nil:
		return "its host PVC does not exist"
	case pvc.Spec.VolumeName == "":
		return "its host PVC has no Longhorn volume"
	}
	fs := v.exports[pvc.Spec.VolumeName]
	switch {
	case fs == nil:
		return fmt.Sprintf("NetworkFilesystem %s/%s does not exist", host.NetworkFSNamespace, pvc.Spec.VolumeName)
	case !fs.Serving():
		return fs.Describe() + " is not serving"
	}
	return ""
}

func (v *view) judgeQueue(r *report) {
	for _, st := range v.in.Queue {
		if st.LastError != "" {
			r.add(Finding{Kind: FailingVM, VM: st.VM, Detail: fmt.Sprintf("attempts failing since %s: %s",
				st.FailingSince.UTC().Format(time.RFC3339), st.LastError)})
		}
		for _, it := range st.Intents {
			if it.WaitingFor != "" && it.Wedged == nil && v.in.Now.Sub(it.WaitingSince) >= v.in.SlowAfter {
				r.add(Finding{Kind: SlowIntent, Volume: it.Volume, VM: st.VM, Detail: fmt.Sprintf("%s %s for %s",
					it.Op, it.WaitingFor, v.in.Now.Sub(it.WaitingSince).Round(time.Second))})
			}
		}
	}
}

// judgeHolds judges each volume a VM holds: KubeVirt's own state of it, and
// whether the guest asks for it there.
func (v *view) judgeHolds(r *report) {
	for _, vol := range sortedKeys(v.holds) {
		holders := sortedKeys(v.holds[vol])
		for _, vm := range holders {
			h := v.holds[vol][vm]
			v.judgeKubeVirt(r, vol, vm, h)
			v.judgeWanted(r, vol, vm, h)
		}
		if len(holders) > 1 {
			r.add(Finding{Kind: TwoHolders, Volume: vol, Detail: "held by " + strings.Join(holders, ", ")})
		}
	}
}

func (v *view) judgeKubeVirt(r *report, vol, vm string, h *hold) {
	vmi := v.vmis[vm]
	if h.status != nil && h.status.Phase != kubevirtv1.VolumeReady {
		r.add(Finding{Kind: NotReady, Volume: vol, VM: vm, Detail: describe(h, vmi)})
	}
	running := vmi != nil && vmi.Status.Phase == kubevirtv1.Running
	switch {
	case h.inSpec && running && !h.inVMISpec && !h.addQueued && !h.removeQueued:
		r.add(Finding{Kind: SpecVMIDrift, Volume: vol, VM: vm, Detail: "in the VM spec but not in its running VMI"})
	case !h.inSpec && h.inVMISpec && !h.addQueued && !h.removeQueued && (h.status == nil || h.status.Phase != kubevirtv1.HotplugVolumeDetaching):
		r.add(Finding{Kind: SpecVMIDrift, Volume: vol, VM: vm, Detail: "in the VMI but not in its VM's spec"})
	}
}

// judgeWanted reports a volume a VM holds that the guest does not ask for
// there. Left alone: what the guest wants there or is detaching from there,
// what the driver is detaching, and a volume with a VolumeAttachment on a
// Node whose VM cannot be told (it may be this one). A volume the guest asks
// for nowhere is judged only on this guest cluster's own VMs: another guest
// cluster may share the namespace, and its volumes are its own business.
func (v *view) judgeWanted(r *report, vol, vm string, h *hold) {
	if !v.in.GuestRead || !h.held() || v.wanted[vol][vm] || v.detaching[vol][vm] || v.unmapped[vol] {
		return
	}
	if op, ok := v.pending[vol][vm]; ok && op == hotplug.Detach {
		return
	}
	switch {
	case v.asked[vol]:
		where := "elsewhere"
		if vms := sortedKeys(v.wanted[vol]); len(vms) > 0 {
			where = "on " + strings.Join(vms, ", ")
		}
		r.add(Finding{Kind: GhostAttachment, Volume: vol, VM: vm, Detail: "held by the VM (" + describe(h, v.vmis[vm]) +
			") but the guest's VolumeAttachments want it " + where})
	case v.nodes.ours[vm] && v.pvs[vol] != nil:
		r.add(Finding{Kind: InVMWithoutAttachment, Volume: vol, VM: vm, Detail: "held by the VM (" + describe(h, v.vmis[vm]) +
			"), a node of this guest cluster, but no guest VolumeAttachment asks for the volume (guest PV " + v.pvs[vol].Name +
			"): the orphan reconciler removes it after its grace period unless the guest Node may still have it mounted"})
	}
}

// nodeMap says which VM each guest Node runs on, and which VMs are this
// guest cluster's nodes.
type nodeMap struct {
	vm   map[string]string // guest Node -> VM
	ours map[string]bool
}

// mapNodes maps a guest Node to its VM by its CSINode's node ID of this
// driver, what the external-attacher sends the driver. A Node whose CSINode
// lacks it (the node plugin restarts and registers again, or never did) is
// mapped by its providerID, harvester://<VM UID> as Harvester's cloud
// provider sets it, else by a VM of its name (upstream requires guest
// hostnames to match VM names): its attachments are still those of that VM.
func mapNodes(in Input) nodeMap {
	m := nodeMap{vm: map[string]string{}, ours: map[string]bool{}}
	for _, cn := range in.CSINodes {
		for _, d := range cn.Spec.Drivers {
			if d.Name == in.Driver && d.NodeID != "" {
				m.vm[cn.Name] = d.NodeID
				m.ours[d.NodeID] = true
			}
		}
	}
	byUID := map[types.UID]string{}
	byName := map[string]bool{}
	for _, vm := range in.VMs {
		byUID[vm.UID] = vm.Name
		byName[vm.Name] = true
	}
	for _, n := range in.Nodes {
		if _, ok := m.vm[n.Name]; ok {
			continue
		}
		vm := ""
		uid, byProvider := strings.CutPrefix(n.Spec.ProviderID, harvesterProviderPrefix)
		if byProvider {
			vm = byUID[types.UID(uid)]
		}
		// A providerID naming no VM here says the Node runs elsewhere: a VM
		// of its name may be another guest cluster's in the same namespace.
		if vm == "" && !byProvider && byName[n.Name] {
			vm = n.Name
		}
		if vm != "" {
			m.vm[n.Name] = vm
			m.ours[vm] = true
		}
	}
	return m
}

// harvesterProviderPrefix starts the providerID Harvester's cloud provider
// gives a guest Node (harvester-cloud-provider v0.2.4
// pkg/cloud-controller-manager/instance.go: "harvester://" + the VM's UID).
const harvesterProviderPrefix = "harvester://"

func setIn[V any](m map[string]map[string]V, a, b string, val V) {
	if m[a] == nil {
		m[a] = map[string]V{}
	}
	m[a][b] = val
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
