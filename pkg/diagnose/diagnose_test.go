package diagnose

import (
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

const drv = "driver.harvesterhci.io"

func vm(name string, vols []string, reqs ...kubevirtv1.VirtualMachineVolumeRequest) kubevirtv1.VirtualMachine {
	v := kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: kubevirtv1.VirtualMachineSpec{Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{}}}
	for _, n := range vols {
		v.Spec.Template.Spec.Volumes = append(v.Spec.Template.Spec.Volumes, hp(n))
	}
	v.Status.VolumeRequests = reqs
	return v
}

func hp(name string) kubevirtv1.Volume {
	return kubevirtv1.Volume{Name: name, VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
		PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: name}, Hotpluggable: true}}}
}

func vmi(name string, phases map[string]kubevirtv1.VolumePhase) kubevirtv1.VirtualMachineInstance {
	v := kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: name}}
	v.Status.Phase = kubevirtv1.Running
	for _, n := range sortedKeys(phases) {
		v.Spec.Volumes = append(v.Spec.Volumes, hp(n))
		st := kubevirtv1.VolumeStatus{Name: n, Phase: phases[n], HotplugVolume: &kubevirtv1.HotplugVolumeStatus{}}
		if phases[n] == kubevirtv1.VolumeReady {
			st.Target = "sda"
		}
		v.Status.VolumeStatus = append(v.Status.VolumeStatus, st)
	}
	return v
}

func va(name, pv, node string, attached bool) storagev1.VolumeAttachment {
	return storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:   storagev1.VolumeAttachmentSpec{Attacher: drv, NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pv}},
		Status: storagev1.VolumeAttachmentStatus{Attached: attached}}
}

func pv(name, handle string) corev1.PersistentVolume {
	return corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.PersistentVolumeSpec{
		PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: drv, VolumeHandle: handle}}}}
}

func csiNode(node, vm string) storagev1.CSINode {
	return storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: node}, Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: drv, NodeID: vm}}}}
}

// reregistering is the CSINode of a Node whose node plugin restarts: kubelet
// took the driver out and has not put it back yet.
func reregistering(node string) storagev1.CSINode {
	return storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: node}}
}

func node(name, providerID string) corev1.Node {
	return corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.NodeSpec{ProviderID: providerID}}
}

func withUID(v kubevirtv1.VirtualMachine, uid string) kubevirtv1.VirtualMachine {
	v.UID = types.UID(uid)
	return v
}

// rwxPV is the guest PV of a ReadWriteMany volume.
func rwxPV(name, handle string) corev1.PersistentVolume {
	p := pv(name, handle)
	p.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany}
	return p
}

// hostClaim is a bound host PVC whose Longhorn volume is lhVolume.
func hostClaim(name, lhVolume string) corev1.PersistentVolumeClaim {
	return corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.PersistentVolumeClaimSpec{VolumeName: lhVolume}}
}

func export(name, state string) host.NetworkFS {
	fs := host.NetworkFS{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: host.NetworkFSNamespace},
		Spec: host.NetworkFSSpec{NetworkFSName: name, DesiredState: state}, Status: host.NetworkFSStatus{State: state}}
	if state == host.NetworkFSEnabled {
		fs.Status.Endpoint, fs.Status.Status = "10.0.0.9", host.EndpointReady
	}
	return fs
}

func kinds(fs []Finding) []string {
	var out []string
	for _, f := range fs {
		out = append(out, f.Kind+"/"+f.Volume+"/"+f.VM)
	}
	return out
}

// TestAHealthyClusterHasNoFindings: a hot-plugged volume Ready on its VM,
// a ReadWriteMany volume whose export serves (nothing of it is in a VM), and
// the volumes of two Nodes whose node plugin is registering again (no node ID
// in their CSINode): one found through its providerID, one named like its VM.
func TestAHealthyClusterHasNoFindings(t *testing.T) {
	in := Input{Driver: drv, Now: time.Now(), SlowAfter: time.Minute, GuestRead: true, NetworkFSRead: true,
		VMs: []kubevirtv1.VirtualMachine{vm("vm-a", []string{"pvc-1"}), withUID(vm("vm-b", []string{"pvc-3"}), "uid-b"), vm("vm-c", []string{"pvc-4"})},
		VMIs: []kubevirtv1.VirtualMachineInstance{vmi("vm-a", map[string]kubevirtv1.VolumePhase{"pvc-1": kubevirtv1.VolumeReady}),
			vmi("vm-b", map[string]kubevirtv1.VolumePhase{"pvc-3": kubevirtv1.VolumeReady}), vmi("vm-c", map[string]kubevirtv1.VolumePhase{"pvc-4": kubevirtv1.VolumeReady})},
		VolumeAttachments: []storagev1.VolumeAttachment{va("csi-1", "pv-1", "node-a", true), va("csi-2a", "pv-2", "node-a", true),
			va("csi-2b", "pv-2", "node-b", true), va("csi-3", "pv-3", "node-b", true), va("csi-4", "pv-4", "vm-c", true)},
		PersistentVolumes: []corev1.PersistentVolume{pv("pv-1", "pvc-1"), rwxPV("pv-2", "pvc-2"), pv("pv-3", "pvc-3"), pv("pv-4", "pvc-4")},
		CSINodes:          []storagev1.CSINode{csiNode("node-a", "vm-a"), reregistering("node-b")},
		Nodes:             []corev1.Node{node("node-a", ""), node("node-b", "harvester://uid-b"), node("vm-c", "")},
		HostClaims: []corev1.PersistentVolumeClaim{hostClaim("pvc-1", "lh-1"), hostClaim("pvc-2", "lh-2"), hostClaim("pvc-3", "lh-3"),
			hostClaim("pvc-4", "lh-4")},
		NetworkFilesystems: []host.NetworkFS{export("lh-2", host.NetworkFSEnabled)},
		// vm-a's attachment pod runs; node-a uses the volume vm-a holds and
		// the shared one, and waits for a volume its VolumeAttachment attaches.
		HostPods: []corev1.Pod{launcher("virt-launcher-vm-a-x", "vm-a"), attachmentPod("hp-volume-a", "virt-launcher-vm-a-x", corev1.PodRunning, "pvc-1")},
	}
	in.VolumeAttachments = append(in.VolumeAttachments, va("csi-5", "pv-5", "node-a", false))
	in.PersistentVolumes = append(in.PersistentVolumes, pv("pv-5", "pvc-5"))
	in.HostClaims = append(in.HostClaims, hostClaim("pvc-5", "lh-5"))
	in.Nodes[0].Status.VolumesInUse = []corev1.UniqueVolumeName{inUse("pvc-1"), inUse("pvc-2"), inUse("pvc-5")}
	got := Check(in)
	if len(got) != 0 {
		t.Fatalf("findings on a healthy cluster: %v", got)
	}
	if code := Report(io.Discard, in, got); code != ExitClean {
		t.Errorf("exit code %d on a healthy cluster, want %d", code, ExitClean)
	}
}

func TestEveryDisagreementIsNamed(t *testing.T) {
	now := time.Now()
	failing := vm("vm-c", nil, kubevirtv1.VirtualMachineVolumeRequest{AddVolumeOptions: &kubevirtv1.AddVolumeOptions{Name: "pvc-6"}})
	failing.Status.Conditions = []kubevirtv1.VirtualMachineCondition{{Type: kubevirtv1.VirtualMachineFailure, Status: corev1.ConditionTrue,
		Reason: "FailedUpdateError", Message: `admission webhook "x" denied the request`}}
	detaching := va("csi-5", "pv-5", "node-b", true)
	detaching.DeletionTimestamp = &metav1.Time{Time: now.Add(-10 * time.Minute)}
	errored := va("csi-7", "pv-7", "node-a", false)
	errored.Status.AttachError = &storagev1.VolumeError{Message: "rpc error: code = FailedPrecondition"}
	in := Input{Driver: drv, Now: now, SlowAfter: time.Minute, GuestRead: true, NetworkFSRead: true,
		VMs: []kubevirtv1.VirtualMachine{
			vm("vm-a", []string{"pvc-1", "pvc-2", "pvc-3"}),
			vm("vm-b", []string{"pvc-3", "pvc-8"}),
			failing,
		},
		VMIs: []kubevirtv1.VirtualMachineInstance{
			// pvc-1 Ready, nobody asks for it: orphaned. pvc-2: in the VM spec, not in the VMI: drift.
			// pvc-4: the VMI lost it while its VA says attached. pvc-8: on vm-b, wanted on vm-a: ghost.
			vmi("vm-a", map[string]kubevirtv1.VolumePhase{"pvc-1": kubevirtv1.VolumeReady, "pvc-3": kubevirtv1.VolumeReady}),
			vmi("vm-b", map[string]kubevirtv1.VolumePhase{"pvc-3": kubevirtv1.HotplugVolumeAttachedToNode, "pvc-8": kubevirtv1.VolumeReady}),
		},
		// pvc-9 and pvc-10 are ReadWriteMany: the export of one is disabled, the other has none.
		// pvc-11 is attached on a Node whose plugin is not registered and whose VM cannot be told.
		VolumeAttachments: []storagev1.VolumeAttachment{va("csi-2", "pv-2", "node-a", false), va("csi-3", "pv-3", "node-a", true),
			va("csi-3b", "pv-3", "node-b", false), va("csi-4", "pv-4", "node-a", true), detaching, errored, va("csi-8", "pv-8", "node-a", false),
			va("csi-9", "pv-9", "node-b", true), va("csi-10", "pv-10", "node-a", true), va("csi-11", "pv-11", "node-x", true)},
		PersistentVolumes: []corev1.PersistentVolume{pv("pv-1", "pvc-1"), pv("pv-2", "pvc-2"), pv("pv-3", "pvc-3"), pv("pv-4", "pvc-4"), pv("pv-5", "pvc-5"), pv("pv-7", "pvc-7"),
			pv("pv-8", "pvc-8"), rwxPV("pv-9", "pvc-9"), rwxPV("pv-10", "pvc-10"), pv("pv-11", "pvc-11")},
		CSINodes:           []storagev1.CSINode{csiNode("node-a", "vm-a"), csiNode("node-b", "vm-b"), reregistering("node-x")},
		Nodes:              []corev1.Node{node("node-a", ""), node("node-b", ""), node("node-x", "harvester://no-such-uid")},
		HostClaims:         []corev1.PersistentVolumeClaim{hostClaim("pvc-9", "lh-9"), hostClaim("pvc-10", "lh-10")},
		NetworkFilesystems: []host.NetworkFS{export("lh-9", host.NetworkFSDisabled)},
		Queue: []hotplug.VMState{{VM: "vm-c", LastError: "forbidden", FailingSince: now.Add(-time.Hour),
			Intents: []hotplug.IntentState{{Volume: "pvc-6", Op: hotplug.Attach, Since: now.Add(-time.Hour), WaitingFor: "waiting for KubeVirt's VM controller", WaitingSince: now.Add(-time.Hour)}}}},
	}
	for _, c := range []string{"pvc-1", "pvc-2", "pvc-3", "pvc-4", "pvc-5", "pvc-6", "pvc-7", "pvc-8", "pvc-11"} {
		in.HostClaims = append(in.HostClaims, hostClaim(c, "lh-"+c[len("pvc-"):]))
	}
	findings := Check(in)
	got := kinds(findings)
	for _, want := range []string{
		InVMWithoutAttachment + "/pvc-1/vm-a",
		GhostAttachment + "/pvc-8/vm-b",
		RWXExportNotEnabled + "/pvc-9/vm-b",
		RWXExportNotEnabled + "/pvc-10/vm-a",
		NodePluginNotRegistered + "//",
		SpecVMIDrift + "/pvc-2/vm-a",
		TwoHolders + "/pvc-3/",
		NotReady + "/pvc-3/vm-b",
		LostAttachment + "/pvc-4/vm-a",
		StuckVolumeAttachment + "/pvc-5/vm-b",
		StuckRequests + "//vm-c",
		FailingVM + "//vm-c",
		SlowIntent + "/pvc-6/vm-c",
		StuckVolumeAttachment + "/pvc-7/vm-a",
	} {
		if !slices.Contains(got, want) {
			t.Errorf("missing finding %s in %v", want, got)
		}
	}
	if slices.Contains(got, GhostAttachment+"/pvc-3/vm-a") {
		t.Errorf("pvc-3 is wanted on vm-a and must not be a ghost there: %v", got)
	}
	for _, f := range findings {
		if (f.Volume == "pvc-9" || f.Volume == "pvc-10" || f.Volume == "pvc-11") && f.Kind != RWXExportNotEnabled {
			t.Errorf("an RWX volume, or one on a Node whose VM is unknown, judged as hot-plugged: %s", f)
		}
		if f.Kind == NodePluginNotRegistered && (!f.Info || f.Node != "node-x" || !strings.Contains(f.Detail, "csi-11")) {
			t.Errorf("the unregistered node must be informational, name the Node and its VolumeAttachment: %+v", f)
		}
	}
	if code := Report(io.Discard, in, findings); code != ExitFindings {
		t.Errorf("exit code %d with disagreements, want %d", code, ExitFindings)
	}
}

// TestOnlyThisGuestsVMsHaveOrphans: another guest cluster's VM in the same
// namespace holds volumes this guest never asks for; they are not this
// guest's orphans. A volume this guest does ask for is its business on any
// VM.
func TestOnlyThisGuestsVMsHaveOrphans(t *testing.T) {
	in := Input{Driver: drv, Now: time.Now(), SlowAfter: time.Minute, GuestRead: true, NetworkFSRead: true,
		VMs: []kubevirtv1.VirtualMachine{vm("vm-a", []string{"pvc-1"}), vm("other-1", []string{"pvc-x", "pvc-2"})},
		VMIs: []kubevirtv1.VirtualMachineInstance{vmi("vm-a", map[string]kubevirtv1.VolumePhase{"pvc-1": kubevirtv1.VolumeReady}),
			vmi("other-1", map[string]kubevirtv1.VolumePhase{"pvc-x": kubevirtv1.VolumeReady, "pvc-2": kubevirtv1.VolumeReady})},
		VolumeAttachments: []storagev1.VolumeAttachment{va("csi-1", "pv-1", "node-a", true), va("csi-2", "pv-2", "node-a", false)},
		PersistentVolumes: []corev1.PersistentVolume{pv("pv-1", "pvc-1"), pv("pv-2", "pvc-2")},
		CSINodes:          []storagev1.CSINode{csiNode("node-a", "vm-a")},
		Nodes:             []corev1.Node{node("node-a", "")},
		HostClaims:        []corev1.PersistentVolumeClaim{hostClaim("pvc-1", "lh-1"), hostClaim("pvc-2", "lh-2")},
	}
	got := kinds(Check(in))
	if want := []string{GhostAttachment + "/pvc-2/other-1"}; !slices.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
}

// TestOrphansAreOnlyThisGuestsVolumesOnItsVMs: two guest clusters share the
// host namespace. A volume no guest PV of this cluster names is never its
// orphan, even on its own VM, and a Node that shares its name with the other
// cluster's VM while its providerID names a VM elsewhere does not make that
// VM this cluster's.
func TestOrphansAreOnlyThisGuestsVolumesOnItsVMs(t *testing.T) {
	in := Input{Driver: drv, Now: time.Now(), SlowAfter: time.Minute, GuestRead: true, NetworkFSRead: true,
		VMs: []kubevirtv1.VirtualMachine{vm("vm-a", []string{"pvc-1", "pvc-theirs"}), vm("other-1", []string{"pvc-x"})},
		VMIs: []kubevirtv1.VirtualMachineInstance{vmi("vm-a", map[string]kubevirtv1.VolumePhase{"pvc-1": kubevirtv1.VolumeReady, "pvc-theirs": kubevirtv1.VolumeReady}),
			vmi("other-1", map[string]kubevirtv1.VolumePhase{"pvc-x": kubevirtv1.VolumeReady})},
		PersistentVolumes: []corev1.PersistentVolume{pv("pv-1", "pvc-1"), pv("pv-x", "pvc-x")},
		CSINodes:          []storagev1.CSINode{csiNode("node-a", "vm-a")},
		Nodes:             []corev1.Node{node("node-a", ""), node("other-1", "harvester://uid-of-a-vm-elsewhere")},
		HostClaims:        []corev1.PersistentVolumeClaim{hostClaim("pvc-1", "lh-1"), hostClaim("pvc-x", "lh-x")},
	}
	got := kinds(Check(in))
	if want := []string{InVMWithoutAttachment + "/pvc-1/vm-a"}; !slices.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
}

// TestAnInformationalFindingExitsClean: diagnose fails only on
// disagreements.
func TestAnInformationalFindingExitsClean(t *testing.T) {
	var out strings.Builder
	info := Finding{Kind: NodePluginNotRegistered, Node: "node-x", Info: true, Detail: "not judged"}
	if code := Report(&out, Input{Driver: drv}, []Finding{info}); code != ExitClean {
		t.Errorf("exit code %d for an informational finding, want %d", code, ExitClean)
	}
	if !strings.Contains(out.String(), "info: "+NodePluginNotRegistered) {
		t.Errorf("the informational finding is not printed as such:\n%s", out.String())
	}
	if code := Report(io.Discard, Input{Driver: drv}, []Finding{info, {Kind: GhostAttachment, Volume: "v", VM: "vm"}}); code != ExitFindings {
		t.Errorf("exit code %d with a disagreement, want %d", code, ExitFindings)
	}
}

func TestADetachInProgressIsNoGhost(t *testing.T) {
	in := Input{Driver: drv, Now: time.Now(), SlowAfter: time.Minute, GuestRead: true,
		VMs:      []kubevirtv1.VirtualMachine{vm("vm-a", []string{"pvc-1"})},
		VMIs:     []kubevirtv1.VirtualMachineInstance{vmi("vm-a", map[string]kubevirtv1.VolumePhase{"pvc-1": kubevirtv1.VolumeReady})},
		CSINodes: []storagev1.CSINode{csiNode("node-a", "vm-a")},
		Queue:    []hotplug.VMState{{VM: "vm-a", Intents: []hotplug.IntentState{{Volume: "pvc-1", Op: hotplug.Detach, Since: time.Now()}}}},
		// The guest PV makes pvc-1 this guest cluster's.
		PersistentVolumes: []corev1.PersistentVolume{pv("pv-1", "pvc-1")},
		HostClaims:        []corev1.PersistentVolumeClaim{hostClaim("pvc-1", "lh-1")},
	}
	if got := Check(in); len(got) != 0 {
		t.Fatalf("a volume the driver is detaching is reported: %v", got)
	}
	in.Queue = nil
	if got := Check(in); len(got) != 1 || got[0].Kind != InVMWithoutAttachment || !strings.Contains(got[0].String(), "vm=vm-a") {
		t.Fatalf("without the detach the volume is an orphan: %v", got)
	}
}
