package diagnose

import (
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// Each wedged intent of the queue is a vm-wedged finding (not also a
// slow-intent) naming the cause the host objects show: a removed volume the
// VMI still lists with its attachment pod, an attachment pod Pending, the
// VM's failing updates, or none visible. An intent that only waits is not
// wedged.
func TestWedgedIntentsAreFindingsWithTheirCause(t *testing.T) {
	now := time.Now()
	since := now.Add(-10 * time.Minute)
	wedge := func(reason, pod string) *hotplug.Wedge {
		return &hotplug.Wedge{Reason: reason, Since: since, State: "waiting for KubeVirt (VMI phase Bound)", AttachmentPod: pod}
	}
	// vm-a: "old" was removed and stays Detaching in the VMI status with its
	// pod (kubevirt PR 18044); "new" waits behind it.
	vmiA := vmi("vm-a", map[string]kubevirtv1.VolumePhase{"new": kubevirtv1.VolumeBound, "old": kubevirtv1.HotplugVolumeDetaching})
	vmiA.Spec.Volumes = vmiA.Spec.Volumes[:1]
	vmiA.Status.VolumeStatus[1].HotplugVolume.AttachPodName = "hp-volume-old"
	// vm-b: its attachment pod does not get scheduled.
	pending := attachmentPod("hp-volume-b", "virt-launcher-vm-b-x", corev1.PodPending, "pvc-b")
	pending.CreationTimestamp = metav1.NewTime(now.Add(-8 * time.Minute))
	pending.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: "Unschedulable",
		Message: "0/3 nodes are available: 1 node(s) were unschedulable."}}
	// vm-c: KubeVirt's update of the VM is denied.
	vmC := vm("vm-c", nil, kubevirtv1.VirtualMachineVolumeRequest{AddVolumeOptions: &kubevirtv1.AddVolumeOptions{Name: "pvc-c"}})
	vmC.Status.Conditions = []kubevirtv1.VirtualMachineCondition{{Type: kubevirtv1.VirtualMachineFailure, Status: corev1.ConditionTrue,
		Reason: "FailedUpdate", Message: "admission webhook denied the request: PVC ns/pvc-x is already used by other VM"}}
	in := Input{Driver: drv, Namespace: "ns", Now: now, SlowAfter: time.Minute, HostPodsRead: true,
		VMs:      []kubevirtv1.VirtualMachine{vm("vm-a", []string{"new"}), vm("vm-b", []string{"pvc-b"}), vmC, vm("vm-d", []string{"pvc-d"})},
		VMIs:     []kubevirtv1.VirtualMachineInstance{vmiA, vmi("vm-b", map[string]kubevirtv1.VolumePhase{"pvc-b": kubevirtv1.VolumeBound}), vmi("vm-c", nil), vmi("vm-d", map[string]kubevirtv1.VolumePhase{"pvc-d": kubevirtv1.VolumeBound})},
		HostPods: []corev1.Pod{launcher("virt-launcher-vm-b-x", "vm-b"), pending, launcher("virt-launcher-vm-d-x", "vm-d")},
		Queue: []hotplug.VMState{
			{VM: "vm-a", Intents: []hotplug.IntentState{
				{Volume: "new", Op: hotplug.Attach, WaitingFor: "waiting", WaitingSince: since, Wedged: wedge(hotplug.WedgePlug, "")},
				{Volume: "old", Op: hotplug.Detach, WaitingFor: "waiting", WaitingSince: since, Wedged: wedge(hotplug.WedgeUnplug, "hp-volume-old")}}},
			{VM: "vm-b", Intents: []hotplug.IntentState{{Volume: "pvc-b", Op: hotplug.Attach, WaitingFor: "waiting", WaitingSince: since, Wedged: wedge(hotplug.WedgePlug, "hp-volume-b")}}},
			{VM: "vm-c", Intents: []hotplug.IntentState{{Volume: "pvc-c", Op: hotplug.Attach, WaitingFor: "waiting", WaitingSince: since, Wedged: wedge(hotplug.WedgeQueuedRequest, "")}}},
			{VM: "vm-d", Intents: []hotplug.IntentState{{Volume: "pvc-d", Op: hotplug.Attach, WaitingFor: "waiting", WaitingSince: since, Wedged: wedge(hotplug.WedgePlug, "hp-volume-d")}}},
			{VM: "vm-e", Intents: []hotplug.IntentState{{Volume: "pvc-e", Op: hotplug.Attach, WaitingFor: "waiting", WaitingSince: now}}},
		},
	}
	want := map[string][]string{
		"vm-a/new":   {causeRemovalStuck, "old (Detaching, attachment pod hp-volume-old)"},
		"vm-a/old":   {causeRemovalStuck, hotplug.WedgeUnplug, "hp-volume-old"},
		"vm-b/pvc-b": {causePodPending, "hp-volume-b", "Unschedulable"},
		"vm-c/pvc-c": {causeVMWrites, "already used by other VM", hotplug.WedgeQueuedRequest},
		"vm-d/pvc-d": {causePodGone, "hp-volume-d"},
	}
	got := map[string]string{}
	for _, f := range Check(in) {
		switch f.Kind {
		case WedgedVM:
			got[f.VM+"/"+f.Volume] = f.Detail
		case SlowIntent:
			t.Errorf("a wedged or young intent is also slow-intent: %s", f)
		}
	}
	if len(got) != len(want) {
		t.Errorf("wedged findings %v, want %d", got, len(want))
	}
	for key, words := range want {
		for _, w := range words {
			if !strings.Contains(got[key], w) {
				t.Errorf("%s: %q does not say %q", key, got[key], w)
			}
		}
	}
	if d := got["vm-a/new"]; strings.Contains(d, causeUnknown) || !strings.Contains(d, "10m0s") {
		t.Errorf("vm-a/new: %q", d)
	}
}
