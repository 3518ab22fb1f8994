package diagnose

import (
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

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

func kinds(fs []Finding) []string {
	var out []string
	for _, f := range fs {
		out = append(out, f.Kind+"/"+f.Volume+"/"+f.VM)
	}
	return out
}

func TestAHealthyClusterHasNoFindings(t *testing.T) {
	in := Input{Driver: drv, Now: time.Now(), SlowAfter: time.Minute,
		VMs:               []kubevirtv1.VirtualMachine{vm("vm-a", []string{"pvc-1"})},
		VMIs:              []kubevirtv1.VirtualMachineInstance{vmi("vm-a", map[string]kubevirtv1.VolumePhase{"pvc-1": kubevirtv1.VolumeReady})},
		VolumeAttachments: []storagev1.VolumeAttachment{va("csi-1", "pv-1", "node-a", true)},
		PersistentVolumes: []corev1.PersistentVolume{pv("pv-1", "pvc-1")},
		CSINodes:          []storagev1.CSINode{csiNode("node-a", "vm-a")},
	}
	if got := Check(in); len(got) != 0 {
		t.Fatalf("findings on a healthy cluster: %v", got)
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
	in := Input{Driver: drv, Now: now, SlowAfter: time.Minute,
		VMs: []kubevirtv1.VirtualMachine{
			vm("vm-a", []string{"pvc-1", "pvc-2", "pvc-3"}),
			vm("vm-b", []string{"pvc-3"}),
			failing,
		},
		VMIs: []kubevirtv1.VirtualMachineInstance{
			// pvc-1 Ready, nobody wants it: ghost. pvc-2: in the VM spec, not in the VMI: drift.
			// pvc-4: the VMI lost it while its VA says attached.
			vmi("vm-a", map[string]kubevirtv1.VolumePhase{"pvc-1": kubevirtv1.VolumeReady, "pvc-3": kubevirtv1.VolumeReady}),
			vmi("vm-b", map[string]kubevirtv1.VolumePhase{"pvc-3": kubevirtv1.HotplugVolumeAttachedToNode}),
		},
		VolumeAttachments: []storagev1.VolumeAttachment{va("csi-2", "pv-2", "node-a", false), va("csi-3", "pv-3", "node-a", true),
			va("csi-3b", "pv-3", "node-b", false), va("csi-4", "pv-4", "node-a", true), detaching, errored},
		PersistentVolumes: []corev1.PersistentVolume{pv("pv-1", "pvc-1"), pv("pv-2", "pvc-2"), pv("pv-3", "pvc-3"), pv("pv-4", "pvc-4"), pv("pv-5", "pvc-5"), pv("pv-7", "pvc-7")},
		CSINodes:          []storagev1.CSINode{csiNode("node-a", "vm-a"), csiNode("node-b", "vm-b")},
		Queue: []hotplug.VMState{{VM: "vm-c", LastError: "forbidden", FailingSince: now.Add(-time.Hour),
			Intents: []hotplug.IntentState{{Volume: "pvc-6", Op: hotplug.Attach, Since: now.Add(-time.Hour), WaitingFor: "waiting for KubeVirt's VM controller", WaitingSince: now.Add(-time.Hour)}}}},
	}
	got := kinds(Check(in))
	for _, want := range []string{
		GhostAttachment + "/pvc-1/vm-a",
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
}

func TestADetachInProgressIsNoGhost(t *testing.T) {
	in := Input{Driver: drv, Now: time.Now(), SlowAfter: time.Minute,
		VMs:               []kubevirtv1.VirtualMachine{vm("vm-a", []string{"pvc-1"})},
		VMIs:              []kubevirtv1.VirtualMachineInstance{vmi("vm-a", map[string]kubevirtv1.VolumePhase{"pvc-1": kubevirtv1.VolumeReady})},
		VolumeAttachments: []storagev1.VolumeAttachment{},
		Queue:             []hotplug.VMState{{VM: "vm-a", Intents: []hotplug.IntentState{{Volume: "pvc-1", Op: hotplug.Detach, Since: time.Now()}}}},
	}
	if got := Check(in); len(got) != 0 {
		t.Fatalf("a volume the driver is detaching is reported: %v", got)
	}
	in.Queue = nil
	if got := Check(in); len(got) != 1 || got[0].Kind != GhostAttachment || !strings.Contains(got[0].String(), "vm=vm-a") {
		t.Fatalf("without the detach the volume is a ghost: %v", got)
	}
}
