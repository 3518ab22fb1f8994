package hotplug

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// vmWith builds a VM whose template holds hotplug volumes (and disks) of the
// given names, plus queued legacy requests.
func vmWith(vols []string, reqs ...kubevirtv1.VirtualMachineVolumeRequest) *kubevirtv1.VirtualMachine {
	vm := &kubevirtv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Name: "vm1", Namespace: "ns"},
		Spec:       kubevirtv1.VirtualMachineSpec{Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{}},
	}
	for _, v := range vols {
		vm.Spec.Template.Spec.Volumes = append(vm.Spec.Template.Spec.Volumes, kubevirtv1.Volume{
			Name: v,
			VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
				PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: v}, Hotpluggable: true,
			}},
		})
		vm.Spec.Template.Spec.Domain.Devices.Disks = append(vm.Spec.Template.Spec.Domain.Devices.Disks, kubevirtv1.Disk{Name: v})
	}
	vm.Status.VolumeRequests = reqs
	return vm
}

// vmiWith builds a running VMI with hotplug volume statuses "name=phase"
// (phase Ready gets a target).
func vmiWith(statuses map[string]kubevirtv1.VolumePhase) *kubevirtv1.VirtualMachineInstance {
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "vm1", Namespace: "ns"}}
	vmi.Status.Phase = kubevirtv1.Running
	for _, name := range sortedKeys(statuses) {
		phase := statuses[name]
		vmi.Spec.Volumes = append(vmi.Spec.Volumes, kubevirtv1.Volume{Name: name, VolumeSource: kubevirtv1.VolumeSource{
			PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
				PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: name}, Hotpluggable: true,
			}}})
		s := kubevirtv1.VolumeStatus{Name: name, Phase: phase, HotplugVolume: &kubevirtv1.HotplugVolumeStatus{}}
		if phase == kubevirtv1.VolumeReady {
			s.Target = "sda"
		}
		vmi.Status.VolumeStatus = append(vmi.Status.VolumeStatus, s)
	}
	return vmi
}

// podStarting names an attachment pod for volume without its UID, as
// virt-controller writes it until the pod's container is ready.
func podStarting(vmi *kubevirtv1.VirtualMachineInstance, volume string) *kubevirtv1.VirtualMachineInstance {
	for i := range vmi.Status.VolumeStatus {
		if s := &vmi.Status.VolumeStatus[i]; s.Name == volume {
			s.HotplugVolume.AttachPodName = "hp-volume-1"
		}
	}
	return vmi
}

// startedPod gives volume's entry the UID of a running attachment pod.
func startedPod(vmi *kubevirtv1.VirtualMachineInstance, volume string) *kubevirtv1.VirtualMachineInstance {
	for i := range vmi.Status.VolumeStatus {
		if s := &vmi.Status.VolumeStatus[i]; s.Name == volume {
			s.HotplugVolume.AttachPodName, s.HotplugVolume.AttachPodUID = "hp-volume-1", "uid-hp-1"
		}
	}
	return vmi
}

// migratingVMI is in a live migration's transfer (after its hand-off).
func migratingVMI(vmi *kubevirtv1.VirtualMachineInstance) *kubevirtv1.VirtualMachineInstance {
	vmi.Status.MigrationState = &kubevirtv1.VirtualMachineInstanceMigrationState{StartTimestamp: &metav1.Time{Time: time.Unix(1e9, 0)}, SourceNode: "h0", TargetNode: "h1"}
	return vmi
}

func addReq(name string) kubevirtv1.VirtualMachineVolumeRequest {
	return kubevirtv1.VirtualMachineVolumeRequest{AddVolumeOptions: &kubevirtv1.AddVolumeOptions{Name: name}}
}

func removeReq(name string) kubevirtv1.VirtualMachineVolumeRequest {
	return kubevirtv1.VirtualMachineVolumeRequest{RemoveVolumeOptions: &kubevirtv1.RemoveVolumeOptions{Name: name}}
}

func TestDecide(t *testing.T) {
	t0 := time.Unix(1000, 0)
	cfg := Config{MaxHold: 30 * time.Second, PodStartHold: 150 * time.Second}
	type in struct {
		intents map[string]Op
		expect  map[string]expectation
		gather  time.Time
		since   time.Time // settling since (with KubeVirt unchanged since then unless moved)
		moved   bool
		obs     observed
		vmGone  bool
		held    map[string]error
		refused map[string]error
		// migrating: the VMI is in a live migration (facts.migrating).
		migrating string
	}
	cases := []struct {
		name        string
		in          in
		wantChanges []Change
		wantResolve map[string]error // volume -> err (nil: success)
		wantHold    string
		wantExpect  []string          // expectations left
		wantWait    map[string]string // volume -> substring of what it waits for
	}{{
		name:        "attach already observed Ready resolves",
		in:          in{intents: map[string]Op{"a": Attach}, obs: observed{vm: vmWith([]string{"a"}), vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.VolumeReady})}},
		wantResolve: map[string]error{"a": nil},
	}, {
		name: "attach in spec but not Ready yet waits without writing",
		in:   in{intents: map[string]Op{"a": Attach}, obs: observed{vm: vmWith([]string{"a"}), vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeMounted})}},
	}, {
		name:     "first intent waits for the batch window",
		in:       in{intents: map[string]Op{"a": Attach}, gather: t0.Add(time.Second), obs: observed{vm: vmWith(nil), vmi: vmiWith(nil)}},
		wantHold: "gathering a batch", wantChanges: []Change{{"a", Attach}},
	}, {
		name:        "removals go before additions",
		in:          in{intents: map[string]Op{"a": Attach, "b": Detach, "c": Attach}, obs: observed{vm: vmWith([]string{"b"}), vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"b": kubevirtv1.VolumeReady})}},
		wantChanges: []Change{{"b", Detach}, {"a", Attach}, {"c", Attach}},
	}, {
		name:     "settling VM is held after our recent write",
		in:       in{intents: map[string]Op{"b": Attach}, since: t0.Add(-5 * time.Second), obs: observed{vm: vmWith([]string{"a"}), vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeAttachedToNode})}},
		wantHold: "previous change still settling", wantChanges: []Change{{"b", Attach}},
	}, {
		name: "a held batch says how many changes it waits behind",
		in: in{intents: map[string]Op{"d": Attach}, since: t0.Add(-5 * time.Second), obs: observed{vm: vmWith([]string{"a", "b", "c"}, addReq("c")),
			vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeAttachedToNode, "b": kubevirtv1.HotplugVolumeMounted, "c": kubevirtv1.VolumeBound})}},
		wantHold: "previous change still settling", wantChanges: []Change{{"d", Attach}},
		wantWait: map[string]string{"d": "queued behind 3 changes KubeVirt is still carrying out"},
	}, {
		name:        "settling VM is written anyway after max hold",
		in:          in{intents: map[string]Op{"b": Attach}, since: t0.Add(-31 * time.Second), obs: observed{vm: vmWith([]string{"a"}), vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeDetaching})}},
		wantChanges: []Change{{"b", Attach}},
	}, {
		name:     "an attachment pod KubeVirt waits for to start holds the VM past max hold",
		in:       in{intents: map[string]Op{"b": Attach}, since: t0.Add(-100 * time.Second), obs: observed{vm: vmWith([]string{"a"}), vmi: podStarting(vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeAttachedToNode}), "a")}},
		wantHold: "previous change still settling", wantChanges: []Change{{"b", Attach}},
	}, {
		name:        "an attachment pod that does not start for the pod-start hold no longer holds the VM",
		in:          in{intents: map[string]Op{"b": Attach}, since: t0.Add(-151 * time.Second), obs: observed{vm: vmWith([]string{"a"}), vmi: podStarting(vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeAttachedToNode}), "a")}},
		wantChanges: []Change{{"b", Attach}},
	}, {
		name: "settling VM whose KubeVirt work moved since is held again, however long ago the hold began",
		in: in{intents: map[string]Op{"b": Attach}, since: t0.Add(-time.Hour), moved: true,
			obs: observed{vm: vmWith([]string{"a"}), vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeMounted})}},
		wantHold: "previous change still settling", wantChanges: []Change{{"b", Attach}},
	}, {
		name:        "a missing claim does not hold the VM",
		in:          in{intents: map[string]Op{"b": Attach}, since: t0.Add(-time.Second), obs: observed{vm: vmWith([]string{"a"}), vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.VolumePending})}},
		wantChanges: []Change{{"b", Attach}},
	}, {
		name: "unobserved own write: neither judged nor rewritten",
		in: in{intents: map[string]Op{"a": Detach}, expect: map[string]expectation{"a": {op: Attach, since: t0.Add(-time.Second)}},
			obs: observed{vm: vmWith(nil), vmi: vmiWith(nil)}},
		wantExpect: []string{"a"},
	}, {
		name: "reflected write clears the expectation and judges again",
		in: in{intents: map[string]Op{"a": Detach}, expect: map[string]expectation{"a": {op: Attach, since: t0.Add(-time.Second)}},
			obs: observed{vm: vmWith([]string{"a"}), vmi: vmiWith(nil)}},
		wantChanges: []Change{{"a", Detach}},
	}, {
		name: "expired expectation is dropped",
		in: in{intents: map[string]Op{"a": Detach}, expect: map[string]expectation{"a": {op: Attach, since: t0.Add(-time.Minute)}},
			obs: observed{vm: vmWith(nil), vmi: vmiWith(nil)}},
		wantResolve: map[string]error{"a": nil},
	}, {
		name:        "attach to a VM the API server says is gone fails",
		in:          in{intents: map[string]Op{"a": Attach}, obs: observed{}, vmGone: true},
		wantResolve: map[string]error{"a": ErrVMNotFound},
	}, {
		name:     "attach to a VM the informer does not show yet waits for it",
		in:       in{intents: map[string]Op{"a": Attach}, obs: observed{}},
		wantHold: "VM not in the informer yet",
	}, {
		name: "exclusive attach of a volume another VM holds now is refused, not written",
		in: in{intents: map[string]Op{"a": Attach, "b": Attach}, obs: observed{vm: vmWith(nil), vmi: vmiWith(nil)},
			held: map[string]error{"a": &HeldError{Volume: "a", VM: "vm2", State: "attaching"}}},
		wantResolve: map[string]error{"a": errHeld},
		wantChanges: []Change{{"b", Attach}},
	}, {
		name: "a volume held elsewhere that is already in this VM's spec is left alone",
		in: in{intents: map[string]Op{"a": Attach}, obs: observed{vm: vmWith([]string{"a"}), vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeMounted})},
			held: map[string]error{"a": &HeldError{Volume: "a", VM: "vm2", State: "attached"}}},
	}, {
		name: "detach waits for a VMI that outlives its VM",
		in:   in{intents: map[string]Op{"a": Detach}, obs: observed{vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.VolumeReady})}},
	}, {
		name:        "detach from a gone VM and VMI is done",
		in:          in{intents: map[string]Op{"a": Detach}, obs: observed{}},
		wantResolve: map[string]error{"a": nil},
	}, {
		name: "attach of a Ready volume whose legacy removal is queued is not done: it waits for the removal",
		in: in{intents: map[string]Op{"a": Attach}, obs: observed{vm: vmWith([]string{"a"}, removeReq("a")),
			vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.VolumeReady})}},
	}, {
		name: "re-add while the VMI still has the old entry detaching waits for it to go",
		in: in{intents: map[string]Op{"a": Attach}, obs: observed{vm: vmWith(nil),
			vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeDetaching})}},
		wantWait: map[string]string{"a": "drop the previous attachment of the volume (VMI phase Detaching"},
	}, {
		name: "re-add waits for an old entry however long, never forced by max hold",
		in: in{intents: map[string]Op{"a": Attach, "b": Attach}, since: t0.Add(-time.Hour), obs: observed{vm: vmWith(nil),
			vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeUnMounted})}},
		wantChanges: []Change{{"b", Attach}},
		wantWait:    map[string]string{"a": "UnMountedFromPod"},
	}, {
		name: "re-add of a volume the VMI still holds Ready but its VM lost (legacy removal applied to the VM only) adds it to the VM again",
		in: in{intents: map[string]Op{"a": Attach}, obs: observed{vm: vmWith(nil),
			vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.VolumeReady})}},
		wantChanges: []Change{{"a", Attach}},
	}, {
		name: "re-add of a volume the VMI holds while a removal of it is queued waits",
		in: in{intents: map[string]Op{"a": Attach}, obs: observed{vm: vmWith(nil, removeReq("a")),
			vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.VolumeReady})}},
		wantWait: map[string]string{"a": "drop the previous attachment"},
	}, {
		name: "legacy add request queued: attach waits",
		in:   in{intents: map[string]Op{"a": Attach}, obs: observed{vm: vmWith(nil, addReq("a")), vmi: vmiWith(nil)}},
	}, {
		name:        "legacy add request queued: detach removes it",
		in:          in{intents: map[string]Op{"a": Detach}, obs: observed{vm: vmWith(nil, addReq("a")), vmi: vmiWith(nil)}},
		wantChanges: []Change{{"a", Detach}}, wantHold: "previous change still settling",
	}, {
		name: "refused legacy add fails alone and is withdrawn at once",
		in: in{intents: map[string]Op{"a": Attach, "b": Attach}, since: t0.Add(-time.Second),
			obs:     observed{vm: failedVM(vmWith(nil, addReq("a"), addReq("b")), `admission webhook "x" denied the request: volume a is refused`), vmi: vmiWith(nil)},
			refused: map[string]error{"a": errors.New(`admission webhook "x" denied the request: volume a is refused`)}},
		wantResolve: map[string]error{"a": errDenied},
		wantChanges: []Change{{"a", Detach}},
	}, {
		name: "legacy add refused by Harvester's validator for a volume no other VM holds waits for KubeVirt's retry",
		in: in{intents: map[string]Op{"a": Attach}, since: t0.Add(-time.Second),
			obs:     observed{vm: failedVM(vmWith(nil, addReq("a")), harvesterOccupied), vmi: vmiWith(nil)},
			refused: map[string]error{"a": &PassingRefusal{Err: errors.New(harvesterOccupied)}}},
		wantWait: map[string]string{"a": "refused for now"},
	}, {
		name: "legacy add refused by Harvester's validator for a volume another VM holds is withdrawn",
		in: in{intents: map[string]Op{"a": Attach}, since: t0.Add(-time.Second),
			obs:     observed{vm: failedVM(vmWith(nil, addReq("a")), harvesterOccupied), vmi: vmiWith(nil)},
			held:    map[string]error{"a": &HeldError{Volume: "a", VM: "vm2", State: "attached"}},
			refused: map[string]error{"a": &PassingRefusal{Err: errors.New(harvesterOccupied)}}},
		wantResolve: map[string]error{"a": errDenied},
		wantChanges: []Change{{"a", Detach}},
	}, {
		name:        "detach of a volume gone from the VM but still on the VMI waits",
		in:          in{intents: map[string]Op{"a": Detach}, obs: observed{vm: vmWith(nil), vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeDetaching})}},
		wantChanges: nil,
	}, {
		name: "nothing is written into a live migration",
		in: in{intents: map[string]Op{"a": Attach, "b": Detach}, migrating: "with virt-launcher pods on host nodes h0 and h1",
			obs: observed{vm: vmWith([]string{"b"}), vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"b": kubevirtv1.VolumeReady})}},
		wantHold: "live migration under way",
		wantWait: map[string]string{"a": "waiting for the VM's live migration (with virt-launcher pods on host nodes h0 and h1) to end", "b": "live migration"},
	}, {
		name: "a migration before its hand-off withdraws our adds whose attachment pod has not started, and only those",
		in: in{intents: map[string]Op{"pending": Attach, "podless": Attach, "started": Attach, "mounted": Attach, "queued": Attach}, migrating: "with virt-launcher pods on host nodes h0 and h1",
			obs: observed{vm: vmWith([]string{"pending", "podless", "started", "mounted"}, addReq("queued")), vmi: startedPod(podStarting(vmiWith(map[string]kubevirtv1.VolumePhase{
				"pending": kubevirtv1.VolumePending, "podless": kubevirtv1.HotplugVolumeAttachedToNode, "started": kubevirtv1.HotplugVolumeAttachedToNode, "mounted": kubevirtv1.HotplugVolumeMounted}), "podless"), "started")}},
		wantChanges: []Change{{"pending", Detach}, {"podless", Detach}, {"queued", Detach}},
		wantWait:    map[string]string{"pending": "withdrawn from the VM while its live migration starts", "started": "waiting for KubeVirt to plug"},
	}, {
		name: "after the hand-off nothing is withdrawn",
		in: in{intents: map[string]Op{"pending": Attach}, migrating: "from host node h0 to h1",
			obs: observed{vm: vmWith([]string{"pending"}), vmi: migratingVMI(vmiWith(map[string]kubevirtv1.VolumePhase{"pending": kubevirtv1.VolumePending}))}},
		wantHold: "live migration under way",
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			w := &vmWork{intents: map[string]*intent{}, expect: map[string]expectation{}, gatherUntil: tc.in.gather, settlingSince: tc.in.since}
			if !tc.in.since.IsZero() && !tc.in.moved {
				w.progress = tc.in.obs.progressMark()
			}
			for v, op := range tc.in.intents {
				w.intents[v] = &intent{vm: "vm1", volume: v, op: op, created: t0, exclusive: true}
			}
			for v, e := range tc.in.expect {
				w.expect[v] = e
			}
			before := fmt.Sprint(w.expect, w.settlingSince, w.gatherUntil, len(w.intents))
			p := decide(t0, cfg, w, facts{o: tc.in.obs, vmGone: tc.in.vmGone, held: tc.in.held, refused: tc.in.refused, migrating: tc.in.migrating})
			if after := fmt.Sprint(w.expect, w.settlingSince, w.gatherUntil, len(w.intents)); after != before {
				t.Errorf("decide changed the VM's work: %s -> %s", before, after)
			}
			if !slices.Equal(p.changes, tc.wantChanges) {
				t.Errorf("changes = %v, want %v", p.changes, tc.wantChanges)
			}
			if p.hold != tc.wantHold {
				t.Errorf("hold = %q, want %q", p.hold, tc.wantHold)
			}
			got := map[string]error{}
			for _, r := range p.resolve {
				got[r.it.volume] = r.err
			}
			if len(got) != len(tc.wantResolve) {
				t.Errorf("resolved %v, want %v", got, tc.wantResolve)
			}
			for v, want := range tc.wantResolve {
				var rejected *RejectedError
				if err, ok := got[v]; ok && want == errDenied && errors.As(err, &rejected) {
					continue
				}
				var held *HeldError
				if err, ok := got[v]; ok && want == errHeld && errors.As(err, &held) {
					continue
				}
				if err, ok := got[v]; !ok || !errors.Is(err, want) && err != want {
					t.Errorf("volume %s resolved with %v (resolved: %v), want %v", v, err, ok, want)
				}
			}
			for v, want := range tc.wantWait {
				if !strings.Contains(p.waits[v].why, want) {
					t.Errorf("volume %s waits for %q, want it to mention %q", v, p.waits[v].why, want)
				}
			}
			var left []string
			for _, v := range sortedKeys(w.expect) {
				if !slices.Contains(p.expired, v) {
					left = append(left, v)
				}
			}
			if !slices.Equal(left, tc.wantExpect) && len(left)+len(tc.wantExpect) > 0 {
				t.Errorf("expectations left %v, want %v", left, tc.wantExpect)
			}
		})
	}
}

// errDenied and errHeld stand for "any RejectedError" and "any HeldError"
// in the table.
var (
	errDenied = errors.New("rejected")
	errHeld   = errors.New("held")
)

// harvesterOccupied is Harvester's validator refusing the legacy VM
// controller's spec update, as the VM's Failure condition says it.
const harvesterOccupied = `Error encountered when trying to update vm according to add volume requests: admission webhook "validator.harvesterhci.io" denied the request: PVC guests/a is already used by other VM, please use a shareable RWX volume.`

func failedVM(vm *kubevirtv1.VirtualMachine, msg string) *kubevirtv1.VirtualMachine {
	vm.Status.Conditions = append(vm.Status.Conditions, kubevirtv1.VirtualMachineCondition{
		Type: kubevirtv1.VirtualMachineFailure, Status: "True", Reason: "FailedUpdateError", Message: msg,
	})
	return vm
}

// An attachment pod starting is KubeVirt moving: the hold's clock starts
// again when virt-controller names the running pod's UID, and a removed
// volume's old pod does not count as one starting.
func TestAttachmentPodStartIsProgress(t *testing.T) {
	starting := observed{vm: vmWith([]string{"a"}), vmi: podStarting(vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeAttachedToNode}), "a")}
	running := observed{vm: starting.vm, vmi: starting.vmi.DeepCopy()}
	running.vmi.Status.VolumeStatus[0].HotplugVolume.AttachPodUID = "uid-1"
	if !starting.podStarting() || running.podStarting() {
		t.Errorf("podStarting: %t with no UID, %t with one; want true, false", starting.podStarting(), running.podStarting())
	}
	if starting.progressMark() == running.progressMark() {
		t.Errorf("the pod's UID appearing left the progress mark at %q", starting.progressMark())
	}
	removed := observed{vm: vmWith(nil), vmi: starting.vmi.DeepCopy()}
	removed.vmi.Spec.Volumes = nil
	if removed.podStarting() {
		t.Error("a removed volume's entry without a UID counted as a pod starting")
	}
}

// A late add joins the attachment pod KubeVirt is starting for the VM's last
// write only while that is safe and cheap: once per cycle, within the join
// window, with nothing of the VM mounted or on its way out.
func TestDecideJoin(t *testing.T) {
	t0 := time.Unix(1000, 0)
	cfg := Config{MaxHold: 30 * time.Second, PodStartHold: 150 * time.Second, JoinWindow: 5 * time.Second}
	starting := func() observed { // "a" written a second ago, its pod created, not running
		return observed{vm: vmWith([]string{"a", "r"}), vmi: podStarting(vmiWith(map[string]kubevirtv1.VolumePhase{
			"a": kubevirtv1.HotplugVolumeAttachedToNode, "r": kubevirtv1.VolumeReady}), "a")}
	}
	cases := []struct {
		name    string
		cfg     func(*Config)
		work    func(*vmWork)
		obs     func(observed) observed
		intents map[string]Op
		join    bool
	}{
		{name: "an add within the window joins the starting pod", join: true},
		{name: "an add during our own unobserved add joins", join: true, work: func(w *vmWork) {
			w.expect["p"] = expectation{op: Attach, since: t0.Add(-100 * time.Millisecond)}
		}},
		{name: "joining is off", cfg: func(c *Config) { c.JoinWindow = 0 }},
		{name: "past the window", work: func(w *vmWork) { w.cycleStart = t0.Add(-6 * time.Second) }},
		{name: "a second join in one cycle", work: func(w *vmWork) { w.joined = true }},
		{name: "no write of this process began the cycle", work: func(w *vmWork) { w.cycleStart = time.Time{} }},
		{name: "the starting pod already runs", obs: func(o observed) observed {
			o.vmi.Status.VolumeStatus[0].HotplugVolume.AttachPodUID = "uid-2"
			return o
		}},
		{name: "an entry mounted into the pod, not yet plugged", obs: func(o observed) observed {
			o.vmi.Status.VolumeStatus[0].Phase = kubevirtv1.HotplugVolumeMounted
			return o
		}},
		{name: "a Ready entry without its target yet", obs: func(o observed) observed {
			o.vmi.Status.VolumeStatus[1].Target = ""
			return o
		}},
		{name: "a removal of the VM still in the VMI", obs: func(o observed) observed {
			o.vm = vmWith([]string{"a"})
			return o
		}},
		{name: "a legacy removal queued", obs: func(o observed) observed {
			o.vm = vmWith([]string{"a", "r"}, removeReq("r"))
			return o
		}},
		{name: "our own removal not yet observed", work: func(w *vmWork) {
			w.expect["r"] = expectation{op: Detach, since: t0.Add(-100 * time.Millisecond)}
		}},
		{name: "a removal in the batch", intents: map[string]Op{"b": Attach, "r": Detach}},
		{name: "the VMI paused on an I/O error", obs: func(o observed) observed {
			o.vmi.Status.Conditions = []kubevirtv1.VirtualMachineInstanceCondition{{Type: kubevirtv1.VirtualMachineInstancePaused, Status: "True", Reason: "PausedIOError"}}
			return o
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := cfg
			if tc.cfg != nil {
				tc.cfg(&c)
			}
			w := &vmWork{intents: map[string]*intent{}, expect: map[string]expectation{}, settlingSince: t0.Add(-time.Second), cycleStart: t0.Add(-time.Second)}
			intents := tc.intents
			if intents == nil {
				intents = map[string]Op{"b": Attach}
			}
			for v, op := range intents {
				w.intents[v] = &intent{vm: "vm1", volume: v, op: op, created: t0, exclusive: true}
			}
			if tc.work != nil {
				tc.work(w)
			}
			o := starting()
			if tc.obs != nil {
				o = tc.obs(o)
			}
			w.progress = o.progressMark()
			p := decide(t0, c, w, facts{o: o})
			if p.joins != tc.join || (p.hold == "") != tc.join {
				t.Fatalf("joins = %t, hold = %q (changes %v); want joins %t", p.joins, p.hold, p.changes, tc.join)
			}
			if tc.join && !slices.Equal(p.changes, []Change{{"b", Attach}}) {
				t.Errorf("changes = %v, want the add alone", p.changes)
			}
		})
	}
}

// A hold's log names what the VM's changes wait behind: KubeVirt's adds and
// removals in flight with their phase (and whether the attachment pod
// runs), queued legacy requests, and this process's unobserved writes.
func TestInFlightNamesWhatAHoldWaitsBehind(t *testing.T) {
	vmi := vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeAttachedToNode, "b": kubevirtv1.HotplugVolumeMounted,
		"gone": kubevirtv1.HotplugVolumeDetaching, "done": kubevirtv1.VolumeReady})
	for i := range vmi.Status.VolumeStatus {
		if s := &vmi.Status.VolumeStatus[i]; s.Name == "b" {
			s.HotplugVolume.AttachPodUID = "uid-1"
		}
	}
	o := observed{vm: vmWith([]string{"a", "b", "done"}, addReq("q")), vmi: vmi}
	got := o.inFlight(map[string]expectation{"c": {op: Detach}})
	want := []string{"q:add:queued", "a:add:AttachedToNode", "b:add:MountedToPod/pod-started", "gone:remove:Detaching", "c:ours-detach"}
	if !slices.Equal(got, want) {
		t.Errorf("inFlight = %q, want %q", got, want)
	}
}
