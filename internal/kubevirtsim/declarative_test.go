package kubevirtsim

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// TestDeclarativeDirectPatch: a client patches the VM spec through the proxy
// (one write for three volumes), the controller plugs them; a removal goes
// through the v1.7+ phases; a resourceVersion-guarded patch loses to the
// controller's status write.
func TestDeclarativeDirectPatch(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeDeclarative})
	ctx := testCtx(t, 60*time.Second)
	vols := []string{"pvc-a", "pvc-b", "pvc-c"}
	vmWithClaims(ctx, t, s, ns, "vm1", vols...)
	log := recordPhases(s, ns, "vm1")
	c := proxyKV(t, s)
	s.ResetStats()
	if err := patchVMVolumes(ctx, t, s, c, ns, "vm1", vols, nil); err != nil {
		t.Fatal(err)
	}
	var targets []string
	for _, v := range vols {
		targets = append(targets, ready(t, s, ns, "vm1", v, 20*time.Second))
	}
	slices.Sort(targets)
	if !slices.Equal(targets, []string{"sda", "sdb", "sdc"}) {
		t.Errorf("targets %v", targets)
	}
	st := s.Stats()
	if st.VMSpecWrites != 1 || st.VMStatusWrites != 0 || st.AddVolume != 0 {
		t.Errorf("stats %+v", st)
	}
	if k := (RequestKey{"patch", "kubevirt.io", resVMs, ""}); st.Requests[k] != 1 || st.Answers[k][200] != 1 {
		t.Errorf("per-kind counts %v %v", st.Requests, st.Answers)
	}
	// One attachment pod holds all three (a single set change).
	_, vmi := s.VM(ns, "vm1")
	pods := s.c.attachmentPods(vmi)
	if len(pods) != 1 || len(podVolumes(pods[0])) != 3 || !strings.HasPrefix(pods[0].Name, "hp-volume-") {
		t.Errorf("attachment pods %d", len(pods))
	}

	if err := patchVMVolumes(ctx, t, s, c, ns, "vm1", nil, []string{"pvc-b"}); err != nil {
		t.Fatal(err)
	}
	detached(t, s, ns, "vm1", "pvc-b", 20*time.Second)
	want := []string{"AttachedToNode", "MountedToPod", "Ready", "UnMountedFromPod", "Detaching", "-"}
	log.waitFor(t, "pvc-b", want, 3*time.Second)
	for _, v := range []string{"pvc-a", "pvc-c"} {
		if got := log.get(v); got[len(got)-1] != "Ready" || slices.Contains(got[2:], "AttachedToNode") {
			t.Errorf("%s left Ready: %v", v, got)
		}
	}
	// The remaining Ready entries moved to the new pod with the smaller set.
	_, vmi = s.VM(ns, "vm1")
	if pods = s.c.attachmentPods(vmi); len(pods) != 1 || !sameSet(podVolumes(pods[0]), []string{"pvc-a", "pvc-c"}) {
		t.Fatalf("attachment pods after the removal: %d", len(pods))
	}
	for _, v := range []string{"pvc-a", "pvc-c"} {
		if e, _ := FindVolumeStatus(vmi, v); e.HotplugVolume.AttachPodName != pods[0].Name || e.HotplugVolume.AttachPodUID != pods[0].UID {
			t.Errorf("%s still points at %s", v, e.HotplugVolume.AttachPodName)
		}
	}

	// A client patch guarded by test on resourceVersion fails with 422 when the
	// controller wrote the status in between (it does after every spec change).
	vm := &kubevirtv1.VirtualMachine{}
	if err := c.get(ctx, resVMs, ns, "vm1", vm); err != nil {
		t.Fatal(err)
	}
	patch := fmt.Sprintf(`[{"op":"test","path":"/metadata/resourceVersion","value":%q},{"op":"add","path":"/spec/template/metadata/labels/touched","value":"yes"}]`, vm.ResourceVersion)
	if err := c.patch(ctx, resVMs, ns, "vm1", "", types.JSONPatchType, []byte(patch), nil, vm); err != nil {
		t.Fatal(err)
	}
	err := s.Wait(ctx, ns, "vm1", func(v *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		return v.Status.ObservedGeneration == vm.Generation
	})
	if err != nil {
		t.Fatal(err)
	}
	patch = fmt.Sprintf(`[{"op":"test","path":"/metadata/resourceVersion","value":%q},{"op":"remove","path":"/spec/template/metadata/labels/touched"}]`, vm.ResourceVersion)
	if err := c.patch(ctx, resVMs, ns, "vm1", "", types.JSONPatchType, []byte(patch), nil, vm); !apierrors.IsInvalid(err) {
		t.Errorf("want 422 after the controller's status write, got %v", err)
	}
}

// TestDeclarativeWebhookDenial: a Harvester webhook denial rejects the
// client's patch with 422 (a bad disk is TestDeclarativeController's).
func TestDeclarativeWebhookDenial(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeDeclarative})
	ctx := testCtx(t, 60*time.Second)
	vmWithClaims(ctx, t, s, ns, "vm1", "pvc-denied")
	c := proxyKV(t, s)
	s.Faults().DenyVolume("pvc-denied", "the volume pvc-denied is already used by VM other/vm9")
	err := patchVMVolumes(ctx, t, s, c, ns, "vm1", []string{"pvc-denied"}, nil)
	if !apierrors.IsInvalid(err) || err.Error() != `admission webhook "validator.harvesterhci.io" denied the request: the volume pvc-denied is already used by VM other/vm9` {
		t.Errorf("denial: %v", err)
	}
	// The front counts the refusal as a webhook's denial, apart from races.
	if k := (RequestKey{"patch", "kubevirt.io", resVMs, ""}); s.Stats().Denied[k][http.StatusUnprocessableEntity] != 1 {
		t.Errorf("denials counted %v, want one 422 on %v", s.Stats().Denied, k)
	}
	if c409, c422 := s.Stats().Contended(); c409 != 0 || c422 != 0 {
		t.Errorf("the denial counted as a race: %d 409s, %d 422s contended", c409, c422)
	}
	s.Faults().AllowVolume("pvc-denied")
	if err := patchVMVolumes(ctx, t, s, c, ns, "vm1", []string{"pvc-denied"}, nil); err != nil {
		t.Fatal(err)
	}
	ready(t, s, ns, "vm1", "pvc-denied", 20*time.Second)
}

// TestDeclarativeReaddWaitsForUnplug: a volume removed and re-added at once is
// plugged again only after its previous entry is gone.
func TestDeclarativeReaddWaitsForUnplug(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeDeclarative})
	ctx := testCtx(t, 60*time.Second)
	vmWithClaims(ctx, t, s, ns, "vm1", "pvc-a")
	log := recordPhases(s, ns, "vm1")
	c := proxyKV(t, s)
	if err := patchVMVolumes(ctx, t, s, c, ns, "vm1", []string{"pvc-a"}, nil); err != nil {
		t.Fatal(err)
	}
	ready(t, s, ns, "vm1", "pvc-a", 20*time.Second)
	if err := patchVMVolumes(ctx, t, s, c, ns, "vm1", nil, []string{"pvc-a"}); err != nil {
		t.Fatal(err)
	}
	waitVMI(t, s, ns, "vm1", func(vmi *kubevirtv1.VirtualMachineInstance) bool { return !HasVolume(vmi.Spec.Volumes, "pvc-a") })
	if err := patchVMVolumes(ctx, t, s, c, ns, "vm1", []string{"pvc-a"}, nil); err != nil {
		t.Fatal(err)
	}
	// The old entry is still Ready (not yet unmounted): the VMI must not get
	// the volume back before that entry is gone.
	want := []string{"AttachedToNode", "MountedToPod", "Ready", "UnMountedFromPod", "Detaching", "-", "AttachedToNode", "MountedToPod", "Ready"}
	log.waitFor(t, "pvc-a", want, 20*time.Second)
}

// TestAttachmentPodLivelock reproduces kubevirt issue 16937 (behaviour 5):
// while the hotplug set changes faster than an attachment pod starts, each
// pending pod is deleted and recreated and nothing becomes Ready; once the
// changes stop, everything does.
func TestAttachmentPodLivelock(t *testing.T) {
	t.Parallel()
	// Scaled: pods start in 2s, the set changes every 0.4s.
	s, ns := testSim(t, Options{Mode: ModeDeclarative, Timings: Timings{PodStart: 40 * time.Second}})
	ctx := testCtx(t, 90*time.Second)
	const n = 8
	var names []string
	for i := range n {
		names = append(names, fmt.Sprintf("pvc-%d", i))
	}
	vmWithClaims(ctx, t, s, ns, "vm1", names...)
	created := map[string]bool{}
	var mu = make(chan struct{}, 1)
	mu <- struct{}{}
	_, _ = s.c.podInf.AddEventHandler(cacheHandler(func(obj any) {
		if p := podVMIKey(obj); p == ns+"/vm1" {
			<-mu
			created[obj.(interface{ GetName() string }).GetName()] = true
			mu <- struct{}{}
		}
	}))
	c := proxyKV(t, s)
	start := time.Now()
	for _, v := range names {
		if err := patchVMVolumes(ctx, t, s, c, ns, "vm1", []string{v}, nil); err != nil {
			t.Fatal(err)
		}
		time.Sleep(400 * time.Millisecond)
		_, vmi := s.VM(ns, "vm1")
		for _, e := range vmi.Status.VolumeStatus {
			if e.Phase == kubevirtv1.VolumeReady && e.HotplugVolume != nil {
				t.Fatalf("volume %s became Ready while the set kept changing (after %v)", e.Name, time.Since(start))
			}
		}
	}
	<-mu
	pods := len(created)
	mu <- struct{}{}
	if pods < n/2 {
		t.Errorf("only %d attachment pods were created for %d set changes", pods, n)
	}
	// Changes stop: everything converges.
	for _, v := range names {
		ready(t, s, ns, "vm1", v, 30*time.Second)
	}
	t.Logf("%d attachment pods for %d changes; converged %v after the last change", pods, n, time.Since(start)-time.Duration(n)*400*time.Millisecond)
}
