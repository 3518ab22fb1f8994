package kubevirtsim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"golang.org/x/time/rate"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

const statusHook = `admission webhook "kubevirt-crd-status-validator.kubevirt.io" denied the request: `

func conflictVM(vm, msg string) string {
	return fmt.Sprintf("Operation cannot be fulfilled on virtualmachine.kubevirt.io %q: %s", vm, msg)
}

func conflictVMI(vm, msg string) string {
	return fmt.Sprintf("Operation cannot be fulfilled on virtualmachineinstance.kubevirt.io %q: %s", vm, msg)
}

// TestSubresourceChecksLegacy pins virt-api's checks on the legacy path (v1.7.0):
// feature gate, decoding, fields, not found, the spec checks, the request-list
// checks, dryRun, the status webhook (bus, migration) and the VMI path.
func TestSubresourceChecksLegacy(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeLegacy, Version: V1_7_0})
	ctx := testCtx(t, 90*time.Second)
	vmWithClaims(ctx, t, s, ns, "vm1", "pvc-a", "pvc-b", "pvc-c")

	// 1. feature gate
	if err := s.Faults().SetFeatureGates(ctx, []string{}); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, addVolume(t, s, ns, "vm1", "pvc-a"), 400, "Enable DeclarativeHotplugVolumes or HotplugVolumes feature gate to use this API.")
	expectAnswer(t, removeVolume(t, s, ns, "vm1", "pvc-a"), 400, "Enable DeclarativeHotplugVolumes or HotplugVolumes feature gate to use this API.")
	if err := s.Faults().SetFeatureGates(ctx, []string{GateHotplugVolumes}); err != nil {
		t.Fatal(err)
	}

	// 3. decode, 4. fields
	got := call(t, s, ns, resVMs, "vm1", "addvolume", "{")
	if got.code != 400 || !strings.HasPrefix(got.status.Message, "Can not unmarshal Request body to struct, error: ") {
		t.Errorf("bad body: %s", got)
	}
	expectAnswer(t, call(t, s, ns, resVMs, "vm1", "addvolume", ""), 400, "Can not unmarshal Request body to struct, error: EOF")
	expectAnswer(t, call(t, s, ns, resVMs, "vm1", "addvolume", &kubevirtv1.AddVolumeOptions{}), 400, "AddVolumeOptions requires name to be set")
	expectAnswer(t, call(t, s, ns, resVMs, "vm1", "addvolume", &kubevirtv1.AddVolumeOptions{Name: "x"}), 400, "AddVolumeOptions requires disk to not be nil")
	expectAnswer(t, call(t, s, ns, resVMs, "vm1", "addvolume", &kubevirtv1.AddVolumeOptions{Name: "x", Disk: &kubevirtv1.Disk{}}), 400, "AddVolumeOptions requires VolumeSource to not be nil")
	expectAnswer(t, call(t, s, ns, resVMs, "vm1", "removevolume", &kubevirtv1.RemoveVolumeOptions{}), 400, "RemoveVolumeOptions requires name to be set")

	// 5. not found
	expectAnswer(t, addVolume(t, s, ns, "nope", "pvc-a"), 404, `virtualmachine.kubevirt.io "nope" not found`)
	expectAnswer(t, call(t, s, ns, resVMIs, "nope", "addvolume", addOpts("pvc-a", "pvc-a", "scsi")), 404, `virtualmachineinstance.kubevirt.io "nope" not found`)

	// 6. spec checks
	expectAnswer(t, addVolume(t, s, ns, "vm1", "rootdisk"), 409, conflictVM("vm1", "Unable to add volume [rootdisk] because volume with that name already exists"))
	expectAnswer(t, removeVolume(t, s, ns, "vm1", "rootdisk"), 409, conflictVM("vm1", "Unable to remove volume [rootdisk] because it is not hotpluggable"))
	expectAnswer(t, removeVolume(t, s, ns, "vm1", "pvc-a"), 409, conflictVM("vm1", "Unable to remove volume [pvc-a] because it does not exist"))

	// dryRun validates only.
	dry := addOpts("pvc-a", "pvc-a", "scsi")
	dry.DryRun = []string{metav1.DryRunAll}
	expect202(t, call(t, s, ns, resVMs, "vm1", "addvolume", dry))
	if vm, _ := s.VM(ns, "vm1"); len(vm.Status.VolumeRequests) != 0 {
		t.Errorf("dryRun queued a request: %+v", vm.Status.VolumeRequests)
	}
	// A dryRun whose first element is not "All" is ignored (a real add).
	ignored := addOpts("pvc-c", "pvc-c", "scsi")
	ignored.DryRun = []string{"None", metav1.DryRunAll}
	expect202(t, call(t, s, ns, resVMs, "vm1", "addvolume", ignored))
	ready(t, s, ns, "vm1", "pvc-c", 30*time.Second)

	// 7. request-list checks while the VMI is not running (requests wait).
	expect202(t, addVolume(t, s, ns, "vm1", "pvc-a"))
	ready(t, s, ns, "vm1", "pvc-a", 30*time.Second)
	// A retry of a request that already succeeded.
	expectAnswer(t, addVolume(t, s, ns, "vm1", "pvc-a"), 409, conflictVM("vm1", "Unable to add volume [pvc-a] because volume with that name already exists"))
	if err := s.Faults().SetVMINotRunning(ctx, ns, "vm1", true); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, call(t, s, ns, resVMIs, "vm1", "addvolume", addOpts("pvc-b", "pvc-b", "scsi")), 409, conflictVMI("vm1", "VMI is not running"))
	expect202(t, addVolume(t, s, ns, "vm1", "pvc-b"))
	expectAnswer(t, addVolume(t, s, ns, "vm1", "pvc-b"), 409, conflictVM("vm1", "add volume request for volume [pvc-b] already exists"))
	expect202(t, removeVolume(t, s, ns, "vm1", "pvc-a"))
	expectAnswer(t, removeVolume(t, s, ns, "vm1", "pvc-a"), 409, conflictVM("vm1", "a remove volume request for volume [pvc-a] already exists and is still being processed"))
	// The legacy controller reports why the requests wait.
	err := s.Wait(ctx, ns, "vm1", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		for _, c := range vm.Status.Conditions {
			if c.Type == kubevirtv1.VirtualMachineFailure && c.Reason == ReasonHotPlugVolumeError &&
				c.Message == "Error encountered while handling volume hotplug requests: "+conflictVMI("vm1", "VMI is not running") {
				return true
			}
		}
		return false
	})
	if err != nil {
		vm, _ := s.VM(ns, "vm1")
		t.Fatalf("no HotPlugVolumeError condition: %v %+v", err, vm.Status.Conditions)
	}
	if vm, _ := s.VM(ns, "vm1"); len(vm.Status.VolumeRequests) != 2 || HasVolume(vm.Spec.Template.Spec.Volumes, "pvc-b") {
		t.Errorf("requests should wait untouched: %+v", vm.Status.VolumeRequests)
	}
	if err := s.Faults().SetVMINotRunning(ctx, ns, "vm1", false); err != nil {
		t.Fatal(err)
	}
	ready(t, s, ns, "vm1", "pvc-b", 30*time.Second)
	detached(t, s, ns, "vm1", "pvc-a", 30*time.Second)
	err = s.Wait(ctx, ns, "vm1", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		return len(vm.Status.Conditions) == 0 && len(vm.Status.VolumeRequests) == 0
	})
	if err != nil {
		t.Errorf("condition not cleared: %v", err)
	}

	// Step 6 before step 7: a claim already in use by another volume name.
	expectAnswer(t, call(t, s, ns, resVMs, "vm1", "addvolume", addOpts("other", "pvc-b", "scsi")), 409, conflictVM("vm1", "Unable to add volume source [pvc-b] because it already exists"))

	// 8. status webhook: bus rules and migrations (422).
	expectAnswer(t, call(t, s, ns, resVMs, "vm1", "addvolume", addOpts("pvc-a", "pvc-a", "sata")), 422,
		statusHook+"AddVolume request for disk [pvc-a] requires bus to be 'scsi' or 'virtio'. [sata] is not permitted.")
	lun := addOpts("pvc-a", "pvc-a", "scsi")
	lun.Disk = &kubevirtv1.Disk{DiskDevice: kubevirtv1.DiskDevice{LUN: &kubevirtv1.LunTarget{Bus: "virtio"}}}
	expectAnswer(t, call(t, s, ns, resVMs, "vm1", "addvolume", lun), 422,
		statusHook+"AddVolume request for LUN [pvc-a] requires bus to be 'scsi'. [virtio] is not permitted.")
	if err := s.Faults().SetMigrationInProgress(ctx, ns, "vm1", true); err != nil {
		t.Fatal(err)
	}
	waitVMI(t, s, ns, "vm1", func(vmi *kubevirtv1.VirtualMachineInstance) bool { return isMigrating(vmi) })
	expectAnswer(t, addVolume(t, s, ns, "vm1", "pvc-a"), 422, statusHook+"Cannot handle volume requests while VMI migration is in progress")
	if err := s.Faults().SetMigrationInProgress(ctx, ns, "vm1", false); err != nil {
		t.Fatal(err)
	}
	waitVMI(t, s, ns, "vm1", func(vmi *kubevirtv1.VirtualMachineInstance) bool { return !isMigrating(vmi) })
	// virtio is fine on v1.7+.
	expect202(t, call(t, s, ns, resVMs, "vm1", "addvolume", addOpts("pvc-a", "pvc-a", "virtio")))
	if target := ready(t, s, ns, "vm1", "pvc-a", 30*time.Second); !strings.HasPrefix(target, "vd") {
		t.Errorf("virtio target %q", target)
	}

	// The VMI path on a VM-owned VMI with the legacy gate on is allowed.
	expect202(t, call(t, s, ns, resVMIs, "vm1", "removevolume", &kubevirtv1.RemoveVolumeOptions{Name: "pvc-a"}))
	waitVMI(t, s, ns, "vm1", func(vmi *kubevirtv1.VirtualMachineInstance) bool { return !HasVolume(vmi.Spec.Volumes, "pvc-a") })
	if vm, _ := s.VM(ns, "vm1"); !HasVolume(vm.Spec.Template.Spec.Volumes, "pvc-a") {
		t.Error("the VMI path changed the VM spec")
	}

	st := s.Stats()
	if st.AddVolume == 0 || st.RemoveVolume == 0 || st.Conflicts == 0 || st.Unprocessable < 3 {
		t.Errorf("stats %+v", st)
	}
}

// TestSubresourceChecksV15 pins the 1.5 messages: the gate messages and the
// scsi-only bus rule.
func TestSubresourceChecksV15(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeLegacy, Version: V1_5_3})
	ctx := testCtx(t, 60*time.Second)
	if _, err := s.CreateVM(ctx, VMSpec{Namespace: ns, Name: "vm1"}); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, call(t, s, ns, resVMs, "vm1", "addvolume", addOpts("pvc-a", "pvc-a", "virtio")), 422,
		statusHook+"AddVolume request for [pvc-a] requires disk bus to be 'scsi'. [virtio] is not permitted")
	// DeclarativeHotplugVolumes does not exist in 1.5.
	if err := s.Faults().SetFeatureGates(ctx, []string{GateDeclarativeHotplugVolumes}); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, addVolume(t, s, ns, "vm1", "pvc-a"), 400, "Unable to Add Volume because HotplugVolumes feature gate is not enabled.")
	expectAnswer(t, removeVolume(t, s, ns, "vm1", "pvc-a"), 400, "Unable to Remove Volume because HotplugVolumes feature gate is not enabled.")
}

// TestSubresourceDeclarative pins the declarative VM path (a spec patch, no
// volumeRequests), the owned-VMI rule and the snapshot rule.
func TestSubresourceDeclarative(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeDeclarative, Version: V1_7_0})
	ctx := testCtx(t, 60*time.Second)
	vmWithClaims(ctx, t, s, ns, "vm1", "pvc-a")
	expectAnswer(t, call(t, s, ns, resVMIs, "vm1", "addvolume", addOpts("pvc-a", "pvc-a", "scsi")), 400, fmt.Sprintf("VMI %s/vm1 is owned by a VM", ns))
	s.ResetStats()
	expect202(t, addVolume(t, s, ns, "vm1", "pvc-a"))
	vm, _ := s.VM(ns, "vm1")
	if len(vm.Status.VolumeRequests) != 0 {
		t.Errorf("declarative path queued a request")
	}
	if target := ready(t, s, ns, "vm1", "pvc-a", 30*time.Second); target != "sda" {
		t.Errorf("target %q", target)
	}
	if st := s.Stats(); st.AddVolume != 1 || st.VMSpecWrites != 0 || st.VMStatusWrites != 0 {
		t.Errorf("stats count the simulator's own writes: %+v", st)
	}
	expectAnswer(t, addVolume(t, s, ns, "vm1", "pvc-a"), 409, conflictVM("vm1", "Unable to add volume [pvc-a] because volume with that name already exists"))

	if err := s.Faults().SetSnapshotInProgress(ctx, ns, "vm1", "snap-1"); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, removeVolume(t, s, ns, "vm1", "pvc-a"), 422,
		`admission webhook "virtualmachine-validator.kubevirt.io" denied the request: Cannot update vm disks or volumes until snapshot "snap-1" completes`)
	if err := s.Faults().SetSnapshotInProgress(ctx, ns, "vm1", ""); err != nil {
		t.Fatal(err)
	}
	expect202(t, removeVolume(t, s, ns, "vm1", "pvc-a"))
	detached(t, s, ns, "vm1", "pvc-a", 30*time.Second)
	expectAnswer(t, removeVolume(t, s, ns, "vm1", "pvc-a"), 409, conflictVM("vm1", "Unable to remove volume [pvc-a] because it does not exist"))
}

// TestSubresourceAuthorization: the caller's own token is checked for
// "update virtualmachines/addvolume" in subresources.kubevirt.io.
func TestSubresourceAuthorization(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{})
	url := fmt.Sprintf("%s/apis/subresources.kubevirt.io/v1/namespaces/%s/virtualmachines/vm1/addvolume", s.ProxyURL(), ns)
	for token, want := range map[string]int{"": http.StatusForbidden, "wrong": http.StatusUnauthorized} {
		req, _ := http.NewRequest(http.MethodPut, url, strings.NewReader(`{}`))
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("token %q: %d, want %d", token, resp.StatusCode, want)
		}
	}
}

func waitVMI(t *testing.T, s *Sim, ns, vm string, cond func(*kubevirtv1.VirtualMachineInstance) bool) {
	t.Helper()
	err := s.Wait(testCtx(t, 20*time.Second), ns, vm, func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return vmi != nil && cond(vmi)
	})
	if err != nil {
		t.Fatalf("VMI condition not reached: %v", err)
	}
}

// TestStatusWebhook pins the status validator's own messages on direct
// status writes (the typo "aleady" is KubeVirt's).
func TestStatusWebhook(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeLegacy})
	ctx := testCtx(t, 60*time.Second)
	if _, err := s.CreateVM(ctx, VMSpec{Namespace: ns, Name: "vm1"}); err != nil {
		t.Fatal(err)
	}
	// An ephemeral VMI-only volume (the VMI path with the legacy gate).
	expect202(t, call(t, s, ns, resVMIs, "vm1", "addvolume", addOpts("eph", "claim-1", "scsi")))
	waitVMI(t, s, ns, "vm1", func(vmi *kubevirtv1.VirtualMachineInstance) bool { return HasVolume(vmi.Spec.Volumes, "eph") })
	c := proxyKV(t, s)
	write := func(reqs ...*kubevirtv1.VirtualMachineVolumeRequest) error {
		vm := &kubevirtv1.VirtualMachine{}
		if err := c.get(ctx, resVMs, ns, "vm1", vm); err != nil {
			t.Fatal(err)
		}
		vm.Status.VolumeRequests = nil
		for _, r := range reqs {
			vm.Status.VolumeRequests = append(vm.Status.VolumeRequests, *r)
		}
		vm.Status.Ready = true
		return c.update(ctx, resVMs, ns, "vm1", "status", vm, vm)
	}
	for _, tc := range []struct {
		reqs []*kubevirtv1.VirtualMachineVolumeRequest
		msg  string
	}{
		{[]*kubevirtv1.VirtualMachineVolumeRequest{addReq("x"), addReq("x")}, "AddVolume request for [x] aleady exists"},
		{[]*kubevirtv1.VirtualMachineVolumeRequest{rmReq("y"), rmReq("y")}, "RemoveVolume request for [y] aleady exists"},
		{[]*kubevirtv1.VirtualMachineVolumeRequest{addReq("rootdisk")}, "AddVolume request for [rootdisk] conflicts with an existing volume of the same name on the vmi template."},
		{[]*kubevirtv1.VirtualMachineVolumeRequest{{AddVolumeOptions: addOpts("eph", "claim-2", "scsi")}}, "AddVolume request for [eph] conflicts with an existing volume of the same name on currently running vmi"},
		{[]*kubevirtv1.VirtualMachineVolumeRequest{{AddVolumeOptions: &kubevirtv1.AddVolumeOptions{Name: "nodisk", VolumeSource: addOpts("n", "n", "").VolumeSource}}}, "AddVolume request for [nodisk] requires the disk field to be set."},
		{[]*kubevirtv1.VirtualMachineVolumeRequest{{}}, "VolumeRequests require one of either addVolumeOptions or removeVolumeOptions to be set"},
	} {
		err := write(tc.reqs...)
		if err == nil || err.Error() != statusHook+tc.msg {
			t.Errorf("got %v\nwant %s", err, statusHook+tc.msg)
		}
	}
}

// TestVirtAPIBudgetAndDetachedRequests pins virt-api's client budget and its
// background context (v1.5.3 pkg/virt-config/virt-config.go:87-88,
// subresource.go:297): a call waits for the budget, and a request whose
// caller gave up meanwhile still lands once the budget allows it.
func TestVirtAPIBudgetAndDetachedRequests(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeLegacy, Version: V1_5_3})
	ctx := testCtx(t, 90*time.Second)
	vmWithClaims(ctx, t, s, ns, "vm1", "pvc-a")
	if got := s.api.limit.Limit(); got != rate.Limit(5/s.c.opts.Scale) || s.api.limit.Burst() != 10 {
		t.Fatalf("v1.5.3 budget: %v QPS burst %d, want 5 QPS (scaled by %v) burst 10", got, s.api.limit.Burst(), s.c.opts.Scale)
	}

	// The budget spent, its next request 2 s away; the caller waits 200 ms.
	s.api.limit.SetLimit(rate.Every(2 * time.Second))
	s.api.limit.SetBurst(1)
	s.api.limit.Allow()
	body, err := json.Marshal(addOpts("pvc-a", "pvc-a", "scsi"))
	if err != nil {
		t.Fatal(err)
	}
	callCtx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	url := fmt.Sprintf("%s/apis/subresources.kubevirt.io/v1/namespaces/%s/%s/%s/addvolume", s.ProxyURL(), ns, resVMs, "vm1")
	req, _ := http.NewRequestWithContext(callCtx, http.MethodPut, url, bytes.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+env.Config.BearerToken)
	req.Header.Set("Content-Type", "application/json")
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("the call was answered %d without budget", resp.StatusCode)
	}
	if vm, _ := s.VM(ns, "vm1"); len(vm.Status.VolumeRequests) != 0 {
		t.Fatalf("the add was queued without budget: %+v", vm.Status.VolumeRequests)
	}

	// The request the caller gave up on is carried out as the budget
	// refills.
	s.api.limit.SetLimit(rate.Inf)
	ready(t, s, ns, "vm1", "pvc-a", 30*time.Second)
}
