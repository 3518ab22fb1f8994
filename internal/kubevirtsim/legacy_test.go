package kubevirtsim

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

// hookLog records DiskHook calls; Plug checks that the entry is not Ready yet.
type hookLog struct {
	s       *Sim
	mu      sync.Mutex
	calls   []string
	failing map[string]int // volume -> Plug failures left
}

func (h *hookLog) Plug(_ context.Context, vm, volume, claim string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.failing[volume] > 0 {
		h.failing[volume]--
		h.calls = append(h.calls, "plug-failed "+volume)
		return fmt.Errorf("simulated plug failure")
	}
	ns, name, _ := strings.Cut(vm, "/")
	if _, vmi := h.s.VM(ns, name); vmi != nil {
		if e, ok := FindVolumeStatus(vmi, volume); !ok || e.Phase != kubevirtv1.HotplugVolumeMounted {
			h.calls = append(h.calls, fmt.Sprintf("plug-in-wrong-phase %s %s", volume, e.Phase))
		}
	}
	h.calls = append(h.calls, fmt.Sprintf("plug %s %s %s", vm, volume, claim))
	return nil
}

func (h *hookLog) Unplug(_ context.Context, vm, volume string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls = append(h.calls, fmt.Sprintf("unplug %s %s", vm, volume))
	return nil
}

func (h *hookLog) get() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.calls)
}

func TestLegacyAttachDetachV17(t *testing.T) {
	t.Parallel()
	hook := &hookLog{failing: map[string]int{"pvc-a": 1}}
	s, ns := testSim(t, Options{Mode: ModeLegacy, Version: V1_7_0, DiskHook: hook})
	hook.s = s
	ctx := testCtx(t, 60*time.Second)
	vmWithClaims(ctx, t, s, ns, "vm1", "pvc-a")
	log := recordPhases(s, ns, "vm1")
	s.ResetStats()
	expect202(t, addVolume(t, s, ns, "vm1", "pvc-a"))
	if got := ready(t, s, ns, "vm1", "pvc-a", 20*time.Second); got != "sda" {
		t.Errorf("target %q, want sda", got)
	}
	vm, vmi := s.VM(ns, "vm1")
	if len(vm.Status.VolumeRequests) != 0 {
		t.Errorf("volumeRequests not trimmed: %+v", vm.Status.VolumeRequests)
	}
	if !HasVolume(vmi.Spec.Volumes, "pvc-a") {
		t.Errorf("VMI spec lacks the volume")
	}
	e, _ := FindVolumeStatus(vmi, "pvc-a")
	if e.Reason != "VolumeReady" || e.Message != "Successfully attach hotplugged volume pvc-a to VM" ||
		e.HotplugVolume.AttachPodName == "" || e.HotplugVolume.AttachPodUID == "" || e.PersistentVolumeClaimInfo.ClaimName != "pvc-a" {
		t.Errorf("Ready entry %+v %+v", e, e.HotplugVolume)
	}
	want := []string{"AttachedToNode", "MountedToPod", "Ready"}
	log.waitFor(t, "pvc-a", want, 3*time.Second)
	if st := s.Stats(); st.AddVolume != 1 || st.VMSpecWrites != 0 || st.VMStatusWrites != 0 {
		t.Errorf("stats %+v", st)
	}
	expect202(t, removeVolume(t, s, ns, "vm1", "pvc-a"))
	detached(t, s, ns, "vm1", "pvc-a", 20*time.Second)
	want = []string{"AttachedToNode", "MountedToPod", "Ready", "UnMountedFromPod", "Detaching", "-"}
	log.waitFor(t, "pvc-a", want, 3*time.Second)
	wantCalls := []string{"plug-failed pvc-a", "plug " + ns + "/vm1 pvc-a pvc-a", "unplug " + ns + "/vm1 pvc-a"}
	if got := hook.get(); !slices.Equal(got, wantCalls) {
		t.Errorf("disk hook calls %q, want %q", got, wantCalls)
	}
	if pods := s.c.attachmentPods(vmi); len(pods) != 0 {
		t.Errorf("attachment pods left: %d", len(pods))
	}
}

func TestLegacyRemovalV15(t *testing.T) {
	t.Parallel()
	// Unmounting takes 5 s: v1.5.3 writes Detaching long before virt-handler
	// could report the volume unmounted.
	s, ns := testSim(t, Options{Mode: ModeLegacy, Version: V1_5_3, Timings: Timings{Detach: 100 * time.Second}})
	ctx := testCtx(t, 60*time.Second)
	vmWithClaims(ctx, t, s, ns, "vm1", "pvc-a", "pvc-b")
	log := recordPhases(s, ns, "vm1")
	expect202(t, addVolume(t, s, ns, "vm1", "pvc-a"))
	ready(t, s, ns, "vm1", "pvc-a", 20*time.Second)
	expect202(t, addVolume(t, s, ns, "vm1", "pvc-b"))
	if target := ready(t, s, ns, "vm1", "pvc-b", 20*time.Second); target != "sdb" {
		t.Errorf("second target %q, want sdb", target)
	}
	expect202(t, removeVolume(t, s, ns, "vm1", "pvc-a"))
	detached(t, s, ns, "vm1", "pvc-a", 20*time.Second)
	want := []string{"AttachedToNode", "MountedToPod", "Ready", "Detaching", "-"}
	log.waitFor(t, "pvc-a", want, 3*time.Second)
	// The remaining volume stayed Ready throughout and moved to the new pod.
	if got := log.get("pvc-b"); got[len(got)-1] != "Ready" || slices.Contains(got[2:], "AttachedToNode") {
		t.Errorf("pvc-b phases %v", got)
	}
}

// TestLegacyParallelAdds: parallel addvolume calls on
// one VM race on the volumeRequests compare-and-swap; the losers get 422.
func TestLegacyParallelAdds(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeLegacy, Timings: Timings{RaceWindow: 2 * time.Second}})
	ctx := testCtx(t, 90*time.Second)
	const n = 8
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("pvc-%d", i)
	}
	vmWithClaims(ctx, t, s, ns, "vm1", names...)
	s.ResetStats()
	answers := make([]answer, n)
	var wg sync.WaitGroup
	for i := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			answers[i] = addVolume(t, s, ns, "vm1", names[i])
		}()
	}
	wg.Wait()
	accepted, rejected := 0, 0
	for i, a := range answers {
		switch {
		case a.code == http.StatusAccepted:
			accepted++
		case a.code == http.StatusUnprocessableEntity && a.status.Message == "the server rejected our request due to an error in our request":
			rejected++
		default:
			t.Errorf("%s: unexpected %s", names[i], a)
		}
	}
	if accepted == 0 || rejected == 0 {
		t.Fatalf("want some accepted and some 422s, got %d accepted, %d rejected", accepted, rejected)
	}
	if st := s.Stats(); st.Unprocessable != rejected || st.AddVolume != n || len(st.Denied) != 0 {
		t.Errorf("stats %+v, want %d 422s and no webhook denial (these are races)", st, rejected)
	}
	// Retry like virtctl until each call is accepted or already in.
	for i, a := range answers {
		for a.code == http.StatusUnprocessableEntity {
			a = addVolume(t, s, ns, "vm1", names[i])
		}
		if a.code != http.StatusAccepted {
			t.Errorf("%s: retry got %s", names[i], a)
		}
	}
	// A retry of a call that already succeeded gets a 409.
	a := addVolume(t, s, ns, "vm1", names[0])
	if a.code != http.StatusConflict || (a.status.Message != conflictVM("vm1", "add volume request for volume [pvc-0] already exists") &&
		a.status.Message != conflictVM("vm1", "Unable to add volume [pvc-0] because volume with that name already exists")) {
		t.Errorf("duplicate add: %s", a)
	}
	for _, name := range names {
		ready(t, s, ns, "vm1", name, 30*time.Second)
	}
}

// TestLegacyStoppedVMAndDirectEdit: on a stopped VM requests go to the spec
// and are trimmed at once; with the legacy gate a direct spec edit hotplugs
// nothing.
func TestLegacyStoppedVMAndDirectEdit(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeLegacy})
	ctx := testCtx(t, 60*time.Second)
	if _, err := s.CreatePVC(ctx, ns, "pvc-a", "1Gi", false); err != nil {
		t.Fatal(err)
	}
	if _, err := s.CreateVM(ctx, VMSpec{Namespace: ns, Name: "off", Stopped: true}); err != nil {
		t.Fatal(err)
	}
	expect202(t, addVolume(t, s, ns, "off", "pvc-a"))
	err := s.Wait(ctx, ns, "off", func(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return vmi == nil && HasVolume(vm.Spec.Template.Spec.Volumes, "pvc-a") && len(vm.Status.VolumeRequests) == 0
	})
	if err != nil {
		t.Fatalf("stopped VM: %v", err)
	}

	if _, err := s.CreateVM(ctx, VMSpec{Namespace: ns, Name: "on"}); err != nil {
		t.Fatal(err)
	}
	c := proxyKV(t, s)
	if err := patchVMVolumes(ctx, t, s, c, ns, "on", []string{"pvc-a"}, nil); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if _, vmi := s.VM(ns, "on"); HasVolume(vmi.Spec.Volumes, "pvc-a") {
		t.Error("a direct spec edit hotplugged a volume in legacy mode")
	}
	// Starting the stopped VM brings its template hotplug volume up.
	if err := s.StartVM(ctx, ns, "off"); err != nil {
		t.Fatal(err)
	}
	ready(t, s, ns, "off", "pvc-a", 20*time.Second)
}

// TestLegacySpecUpdateDenied: the VMI is patched before the VM spec; when the
// spec update is denied (Harvester webhook, snapshot) VM and VMI diverge
// until a later pass succeeds.
func TestLegacySpecUpdateDenied(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeLegacy})
	ctx := testCtx(t, 60*time.Second)
	vmWithClaims(ctx, t, s, ns, "vm1", "pvc-bad", "pvc-snap")
	s.Faults().DenyVolume("pvc-bad", "")
	expect202(t, addVolume(t, s, ns, "vm1", "pvc-bad"))
	wantMsg := `Error encountered when trying to update vm according to add volume and/or memory dump requests: admission webhook "validator.harvesterhci.io" denied the request: the volume pvc-bad is refused by an admission policy`
	err := s.Wait(ctx, ns, "vm1", func(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return failure(vm, ReasonFailedUpdateError, wantMsg) && HasVolume(vmi.Spec.Volumes, "pvc-bad") && !HasVolume(vm.Spec.Template.Spec.Volumes, "pvc-bad")
	})
	if err != nil {
		vm, _ := s.VM(ns, "vm1")
		t.Fatalf("no divergence: %v %+v", err, vm.Status.Conditions)
	}
	s.Faults().AllowVolume("pvc-bad")
	ready(t, s, ns, "vm1", "pvc-bad", 30*time.Second)

	if err := s.Faults().SetSnapshotInProgress(ctx, ns, "vm1", "snap"); err != nil {
		t.Fatal(err)
	}
	expect202(t, addVolume(t, s, ns, "vm1", "pvc-snap"))
	err = s.Wait(ctx, ns, "vm1", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		return failure(vm, ReasonFailedUpdateError, `admission webhook "virtualmachine-validator.kubevirt.io" denied the request: Cannot update vm disks or volumes until snapshot "snap" completes`)
	})
	if err != nil {
		t.Fatalf("snapshot did not block the spec update: %v", err)
	}
	if err := s.Faults().SetSnapshotInProgress(ctx, ns, "vm1", ""); err != nil {
		t.Fatal(err)
	}
	ready(t, s, ns, "vm1", "pvc-snap", 30*time.Second)
}

func failure(vm *kubevirtv1.VirtualMachine, reason, msgPart string) bool {
	if vm == nil {
		return false
	}
	for _, c := range vm.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineFailure && c.Reason == reason && strings.Contains(c.Message, msgPart) {
			return true
		}
	}
	return false
}
