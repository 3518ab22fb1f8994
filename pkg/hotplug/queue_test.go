package hotplug

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt/fake"

	"github.com/harvester-csi/harvester-csi-driver/internal/testmetrics"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

const ns = "ns"

// fakeKubeVirt is a Backend over a fake clientset: Apply edits the VM spec,
// and after readyDelay the VMI follows the spec with every hotplug volume
// Ready, as the declarative controller and virt-handler would.
type fakeKubeVirt struct {
	t          *testing.T
	kv         *fake.Clientset
	readyDelay time.Duration
	// override, when set, answers a change instead of applying it.
	override func(vm string, c Change) (Outcome, bool)
	// claims overrides the phase of claims (""; gone); others are Bound.
	claims map[string]corev1.PersistentVolumeClaimPhase
	// lag delays every watch event the queue's informers get, as a slow
	// or partitioned API server connection would.
	lag time.Duration

	mu          sync.Mutex
	pvcs        map[string]*fakePVC
	hostReqs    hostRequests
	applies     int
	writes      int
	inflight    map[string]int
	maxInflight int
	// launchers are the virt-launcher pods that may still run, by UID.
	launchers map[types.UID]bool
	vmiMu     sync.Mutex
}

func newFakeKubeVirt(t *testing.T, vms ...string) *fakeKubeVirt {
	f := &fakeKubeVirt{t: t, kv: fake.NewSimpleClientset(), readyDelay: 20 * time.Millisecond, inflight: map[string]int{}}
	for _, name := range vms {
		f.addVM(name)
	}
	return f
}

func (f *fakeKubeVirt) addVM(name string) {
	ctx := context.Background()
	vm := vmWith(nil)
	vm.Name = name
	vmi := vmiWith(nil)
	vmi.Name = name
	if _, err := f.kv.KubevirtV1().VirtualMachines(ns).Create(ctx, vm, metav1.CreateOptions{}); err != nil {
		f.t.Fatal(err)
	}
	if _, err := f.kv.KubevirtV1().VirtualMachineInstances(ns).Create(ctx, vmi, metav1.CreateOptions{}); err != nil {
		f.t.Fatal(err)
	}
}

func (f *fakeKubeVirt) Name() string { return "fake" }

func (f *fakeKubeVirt) Refusal(*kubevirtv1.VirtualMachine, string) error { return nil }

func (f *fakeKubeVirt) Start(context.Context, func(string)) error { return nil }

func (f *fakeKubeVirt) VMExists(ctx context.Context, vm string) (bool, error) {
	_, err := f.kv.KubevirtV1().VirtualMachines(ns).Get(ctx, vm, metav1.GetOptions{})
	return err == nil, nil
}

// fakePVC is what the fake keeps of a host PVC: its resourceVersion and its
// reservation.
type fakePVC struct {
	version  int
	reserved Reservation
}

// pvcLocked returns the PVC of claim, made on first use.
func (f *fakeKubeVirt) pvcLocked(claim string) *fakePVC {
	if f.pvcs == nil {
		f.pvcs = map[string]*fakePVC{}
	}
	p := f.pvcs[claim]
	if p == nil {
		p = &fakePVC{version: 1}
		f.pvcs[claim] = p
	}
	return p
}

func (p *fakePVC) claim(name string, phase corev1.PersistentVolumeClaimPhase) HostClaim {
	return HostClaim{Phase: phase, Exists: true, Reserved: p.reserved,
		Object: &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: name, ResourceVersion: strconv.Itoa(p.version)}}}
}

// hostRequests counts the fake host's claim and list requests.
type hostRequests struct {
	claimReads, claimWrites, vmLists, vmiLists, launcherLists, wakes int
}

func (f *fakeKubeVirt) requests() hostRequests {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.hostReqs
}

// Claim says every claim is Bound unless f.claims says otherwise.
func (f *fakeKubeVirt) Claim(_ context.Context, claim string) (HostClaim, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hostReqs.claimReads++
	return f.claimLocked(claim), nil
}

func (f *fakeKubeVirt) claimLocked(claim string) HostClaim {
	phase := corev1.ClaimBound
	if p, ok := f.claims[claim]; ok {
		if p == "" {
			return HostClaim{}
		}
		phase = p
	}
	return f.pvcLocked(claim).claim(claim, phase)
}

// Reserve writes the reservation if the PVC is still at the version read,
// as the API server's resourceVersion precondition does.
func (f *fakeKubeVirt) Reserve(_ context.Context, from HostClaim, r Reservation) (HostClaim, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hostReqs.claimWrites++
	name := from.Object.Name
	if p, ok := f.claims[name]; ok && p == "" {
		return HostClaim{}, apierrors.NewNotFound(schema.GroupResource{Resource: "persistentvolumeclaims"}, name)
	}
	p := f.pvcLocked(name)
	if from.Object.ResourceVersion != strconv.Itoa(p.version) {
		return HostClaim{}, apierrors.NewConflict(schema.GroupResource{Resource: "persistentvolumeclaims"}, name, errors.New("the object has been modified"))
	}
	p.version++
	p.reserved = r
	return p.claim(name, from.Phase), nil
}

// reservation returns the volume's reservation as the fake host holds it.
func (f *fakeKubeVirt) reservation(claim string) Reservation {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pvcLocked(claim).reserved
}

func (f *fakeKubeVirt) ListVMs(ctx context.Context) ([]kubevirtv1.VirtualMachine, error) {
	f.mu.Lock()
	f.hostReqs.vmLists++
	f.mu.Unlock()
	l, err := f.kv.KubevirtV1().VirtualMachines(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	return l.Items, nil
}

func (f *fakeKubeVirt) ListVMIs(ctx context.Context) ([]kubevirtv1.VirtualMachineInstance, error) {
	f.mu.Lock()
	f.hostReqs.vmiLists++
	f.mu.Unlock()
	l, err := f.kv.KubevirtV1().VirtualMachineInstances(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	return l.Items, nil
}

func (f *fakeKubeVirt) LiveLaunchers(context.Context, string, types.UID) (map[types.UID]bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hostReqs.launcherLists++
	return maps.Clone(f.launchers), nil
}

// WakeVM annotates the VM as host.Client does, and counts the wakes.
func (f *fakeKubeVirt) WakeVM(ctx context.Context, vm string, at time.Time) error {
	f.mu.Lock()
	f.hostReqs.wakes++
	f.mu.Unlock()
	patch := fmt.Sprintf(`{"metadata":{"annotations":{"woken-at":%q}}}`, at.Format(time.RFC3339Nano))
	_, err := f.kv.KubevirtV1().VirtualMachines(ns).Patch(ctx, vm, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
	return err
}

func (f *fakeKubeVirt) setLaunchers(live ...types.UID) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.launchers = map[types.UID]bool{}
	for _, uid := range live {
		f.launchers[uid] = true
	}
}

func (f *fakeKubeVirt) Apply(ctx context.Context, vm string, changes []Change) []Outcome {
	f.mu.Lock()
	f.applies++
	f.inflight[vm]++
	f.maxInflight = max(f.maxInflight, f.inflight[vm])
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		f.inflight[vm]--
		f.mu.Unlock()
	}()
	time.Sleep(2 * time.Millisecond) // widen the window in which a second worker could overlap

	outs := make([]Outcome, len(changes))
	obj, err := f.kv.KubevirtV1().VirtualMachines(ns).Get(ctx, vm, metav1.GetOptions{})
	if err != nil {
		for i := range outs {
			outs[i] = Outcome{Result: VMGone, Err: err}
		}
		return outs
	}
	vols := observed{vm: obj}
	names := []string{}
	for _, v := range obj.Spec.Template.Spec.Volumes {
		names = append(names, v.Name)
	}
	changed := false
	for i, c := range changes {
		if f.override != nil {
			if o, ok := f.override(vm, c); ok {
				outs[i] = o
				continue
			}
		}
		switch {
		case c.Op == Attach && vols.inVMSpec(c.Volume), c.Op == Detach && !vols.inVMSpec(c.Volume):
			outs[i] = Outcome{Result: AlreadyDone}
		case c.Op == Attach:
			names = append(names, c.Volume)
			changed = true
		default:
			names = without(names, c.Volume)
			changed = true
		}
	}
	if changed {
		next := vmWith(names)
		obj.Spec.Template.Spec = next.Spec.Template.Spec
		if _, err := f.kv.KubevirtV1().VirtualMachines(ns).Update(ctx, obj, metav1.UpdateOptions{}); err != nil {
			f.t.Errorf("update VM: %v", err)
		}
		f.mu.Lock()
		f.writes++
		f.mu.Unlock()
		time.AfterFunc(f.readyDelay, func() { f.followSpec(vm) })
	}
	return outs
}

// followSpec makes the VMI match the VM's hotplug volumes, all Ready.
func (f *fakeKubeVirt) followSpec(vm string) {
	f.vmiMu.Lock()
	defer f.vmiMu.Unlock()
	ctx := context.Background()
	obj, err := f.kv.KubevirtV1().VirtualMachines(ns).Get(ctx, vm, metav1.GetOptions{})
	if err != nil {
		return
	}
	phases := map[string]kubevirtv1.VolumePhase{}
	for _, v := range obj.Spec.Template.Spec.Volumes {
		phases[v.Name] = kubevirtv1.VolumeReady
	}
	vmi, err := f.kv.KubevirtV1().VirtualMachineInstances(ns).Get(ctx, vm, metav1.GetOptions{})
	if err != nil {
		return
	}
	next := vmiWith(phases)
	vmi.Spec.Volumes, vmi.Status.VolumeStatus = next.Spec.Volumes, next.Status.VolumeStatus
	if _, err := f.kv.KubevirtV1().VirtualMachineInstances(ns).Update(ctx, vmi, metav1.UpdateOptions{}); err != nil {
		f.t.Errorf("update VMI: %v", err)
	}
}

func (f *fakeKubeVirt) stats() (applies, writes, maxInflight int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.applies, f.writes, f.maxInflight
}

func without(list []string, s string) []string {
	out := list[:0:0]
	for _, x := range list {
		if x != s {
			out = append(out, x)
		}
	}
	return out
}

// startQueue runs a queue over informers of the fake clientset.
func startQueue(t *testing.T, f *fakeKubeVirt, cfg Config) (*Queue, *prometheus.Registry) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	informer := func(obj runtime.Object, list func(context.Context, metav1.ListOptions) (runtime.Object, error), w func(context.Context, metav1.ListOptions) (watch.Interface, error)) cache.SharedIndexInformer {
		return cache.NewSharedIndexInformer(&cache.ListWatch{ListWithContextFunc: list, WatchFuncWithContext: w}, obj, 0, cache.Indexers{})
	}
	vms := f.kv.KubevirtV1().VirtualMachines(ns)
	vmis := f.kv.KubevirtV1().VirtualMachineInstances(ns)
	vmInf := informer(&kubevirtv1.VirtualMachine{},
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return vms.List(ctx, o) },
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			w, err := vms.Watch(ctx, o)
			return lagged(w, f.lag), err
		})
	vmiInf := informer(&kubevirtv1.VirtualMachineInstance{},
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return vmis.List(ctx, o) },
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			w, err := vmis.Watch(ctx, o)
			return lagged(w, f.lag), err
		})
	reg := prometheus.NewRegistry()
	cfg.Namespace = ns
	q, err := New(cfg, f, f, vmInf, vmiInf, reg)
	if err != nil {
		t.Fatal(err)
	}
	go vmInf.RunWithContext(ctx)
	go vmiInf.RunWithContext(ctx)
	go func() { _ = q.Run(ctx) }()
	if !cache.WaitForCacheSync(ctx.Done(), vmInf.HasSynced, vmiInf.HasSynced, q.Ready) {
		t.Fatal("informers did not sync")
	}
	return q, reg
}

// waitPending returns once n intents are queued for vm, so a test acts while
// they are pending instead of guessing how long the caller takes to get there.
func waitPending(t *testing.T, q *Queue, vm string, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// Every millisecond: the test acts within the batch window (50 ms).
	testwait.UntilEvery(ctx, t, time.Millisecond, fmt.Sprintf("%d intents pending on %s", n, vm), func() (bool, string) {
		q.mu.Lock()
		got := 0
		if w := q.work[q.key(vm)]; w != nil {
			got = len(w.intents)
		}
		q.mu.Unlock()
		return got >= n, fmt.Sprintf("%d pending", got)
	})
}

func fastConfig() Config {
	return Config{BatchWindow: 50 * time.Millisecond, MaxHold: 2 * time.Second, BackoffBase: time.Millisecond, BackoffMax: 50 * time.Millisecond, QPS: 1000, Burst: 1000}
}

// windowConfig is fastConfig with a batch window long enough for a test to
// act while requests wait in it.
func windowConfig(window time.Duration) Config {
	cfg := fastConfig()
	cfg.BatchWindow = window
	return cfg
}

// attachAll attaches vols to vm one after the other, as callers that each
// wait for their answer, and fails t at the first error.
func attachAll(ctx context.Context, t *testing.T, q *Queue, vm string, vols ...string) {
	t.Helper()
	for _, vol := range vols {
		if err := q.Attach(ctx, vm, vol, true); err != nil {
			t.Fatal(err)
		}
	}
}

func TestConcurrentAttachesAreBatched(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	q, reg := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, 20)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = q.Attach(ctx, "vm1", fmt.Sprintf("pvc-%02d", i), true)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("attach pvc-%02d: %v", i, err)
		}
	}
	_, writes, maxInflight := f.stats()
	if writes > 2 {
		t.Errorf("20 concurrent attaches took %d VM writes, want at most 2", writes)
	}
	if maxInflight != 1 {
		t.Errorf("%d backend calls overlapped on one VM, want 1", maxInflight)
	}
	if n := testutil.CollectAndCount(reg, "harvester_csi_hotplug_intent_duration_seconds"); n == 0 {
		t.Error("no completion latency recorded")
	}
}

func TestAttachThenDetachBeforeTheBatchCancels(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	cfg := windowConfig(300 * time.Millisecond)
	q, _ := startQueue(t, f, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	attachErr := make(chan error, 1)
	go func() { attachErr <- q.Attach(ctx, "vm1", "pvc-a", true) }()
	waitPending(t, q, "vm1", 1) // its batch window is still open
	if err := q.Detach(ctx, "vm1", "pvc-a"); err != nil {
		t.Fatalf("detach: %v", err)
	}
	var superseded *SupersededError
	if err := <-attachErr; !errors.As(err, &superseded) {
		t.Fatalf("attach answered %v, want a SupersededError", err)
	}
	time.Sleep(2 * cfg.BatchWindow)
	if applies, _, _ := f.stats(); applies != 0 {
		t.Errorf("backend called %d times for a cancelled attach, want 0", applies)
	}
	if got := testutil.ToFloat64(q.metrics.superseded); got != 1 {
		t.Errorf("superseded counter = %v, want 1", got)
	}
}

func TestExclusiveVolumeHeldByAnotherVM(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1", "vm2")
	q, _ := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := q.Attach(ctx, "vm1", "pvc-a", true); err != nil {
		t.Fatal(err)
	}
	var held *HeldError
	if err := q.Attach(ctx, "vm2", "pvc-a", true); !errors.As(err, &held) || held.VM != "vm1" {
		t.Fatalf("attach to vm2 answered %v, want HeldError naming vm1", err)
	}
	// Pending (not yet applied) attaches fence too.
	first := make(chan error, 1)
	go func() { first <- q.Attach(ctx, "vm1", "pvc-b", true) }()
	waitPending(t, q, "vm1", 1)
	if err := q.Attach(ctx, "vm2", "pvc-b", true); !errors.As(err, &held) || held.VM != "vm1" {
		t.Fatalf("racing attach answered %v, want HeldError naming vm1", err)
	}
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if err := q.Detach(ctx, "vm1", "pvc-a"); err != nil {
		t.Fatal(err)
	}
	if err := q.Attach(ctx, "vm2", "pvc-a", true); err != nil {
		t.Fatalf("attach after detach: %v", err)
	}
}

func TestRejectedVolumeFailsAlone(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	f.override = func(_ string, c Change) (Outcome, bool) {
		if c.Volume == "pvc-bad" {
			return Outcome{Result: Rejected, Err: errors.New(`admission webhook "x" denied the request`)}, true
		}
		return Outcome{}, false
	}
	q, _ := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	errs := make(chan error, 3)
	for _, v := range []string{"pvc-a", "pvc-bad", "pvc-c"} {
		go func() { errs <- q.Attach(ctx, "vm1", v, true) }()
	}
	var rejected, ok int
	for range 3 {
		var r *RejectedError
		switch err := <-errs; {
		case err == nil:
			ok++
		case errors.As(err, &r) && r.Volume == "pvc-bad":
			rejected++
		default:
			t.Errorf("unexpected answer %v", err)
		}
	}
	if ok != 2 || rejected != 1 {
		t.Errorf("ok=%d rejected=%d, want 2 and 1", ok, rejected)
	}
}

func TestConflictsAreRetried(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	var mu sync.Mutex
	conflicts := 3
	f.override = func(_ string, c Change) (Outcome, bool) {
		mu.Lock()
		defer mu.Unlock()
		if conflicts > 0 {
			conflicts--
			return Outcome{Result: Conflict, Err: errors.New("the server rejected our request due to an error in our request")}, true
		}
		return Outcome{}, false
	}
	q, _ := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := q.Attach(ctx, "vm1", "pvc-a", true); err != nil {
		t.Fatal(err)
	}
	if applies, writes, _ := f.stats(); applies != 4 || writes != 1 {
		t.Errorf("applies=%d writes=%d, want 4 attempts and 1 write", applies, writes)
	}
}

func TestDeadlineKeepsTheIntentForTheRetry(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	f.readyDelay = 400 * time.Millisecond
	q, _ := startQueue(t, f, fastConfig())
	short, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	if err := q.Attach(short, "vm1", "pvc-a", true); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("first attach answered %v, want DeadlineExceeded", err)
	}
	ctx, cancel2 := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel2()
	if err := q.Attach(ctx, "vm1", "pvc-a", true); err != nil {
		t.Fatalf("retry: %v", err)
	}
	if _, writes, _ := f.stats(); writes != 1 {
		t.Errorf("%d VM writes, want 1: the retry must join the work in flight", writes)
	}
}

func TestDetachOfUnattachedVolumeIsImmediate(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	q, _ := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	for _, vm := range []string{"vm1", "no-such-vm"} {
		if err := q.Detach(ctx, vm, "pvc-a"); err != nil {
			t.Errorf("detach from %s: %v", vm, err)
		}
	}
	if applies, _, _ := f.stats(); applies != 0 {
		t.Errorf("backend called %d times, want 0", applies)
	}
}

func TestAttachToUnknownVMIsNotFound(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	q, _ := startQueue(t, f, fastConfig())
	if err := q.Attach(context.Background(), "no-such-vm", "pvc-a", true); !errors.Is(err, ErrVMNotFound) {
		t.Fatalf("got %v, want ErrVMNotFound", err)
	}
}

func TestStormOnSeveralVMsConverges(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1", "vm2", "vm3")
	q, _ := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for v := range 3 {
		vm := fmt.Sprintf("vm%d", v+1)
		for i := range 8 {
			vol := fmt.Sprintf("pvc-%s-%d", vm, i)
			wg.Add(1)
			go func() {
				defer wg.Done()
				for round := range 3 {
					if err := q.Attach(ctx, vm, vol, true); err != nil {
						t.Errorf("round %d attach %s/%s: %v", round, vm, vol, err)
						return
					}
					if err := q.Detach(ctx, vm, vol); err != nil {
						t.Errorf("round %d detach %s/%s: %v", round, vm, vol, err)
						return
					}
				}
			}()
		}
	}
	wg.Wait()
	for v := range 3 {
		o := q.observe(q.key(fmt.Sprintf("vm%d", v+1)))
		if n := len(o.vm.Spec.Template.Spec.Volumes); n != 0 {
			t.Errorf("vm%d still has %d volumes after the storm", v+1, n)
		}
	}
	if _, _, maxInflight := f.stats(); maxInflight != 1 {
		t.Errorf("%d backend calls overlapped on one VM, want 1", maxInflight)
	}
}

func TestMetricsFollowTheQueue(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	q, reg := startQueue(t, f, windowConfig(400*time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	done := make(chan error, 2)
	for _, v := range []string{"pvc-a", "pvc-b"} {
		go func() { done <- q.Attach(ctx, "vm1", v, true) }()
	}
	waitPending(t, q, "vm1", 2) // the batch window is still open
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP harvester_csi_hotplug_queue_depth Pending hotplug intents per VM.
# TYPE harvester_csi_hotplug_queue_depth gauge
harvester_csi_hotplug_queue_depth{backend="fake",vm="vm1"} 2
`), "harvester_csi_hotplug_queue_depth"); err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(reg, "harvester_csi_hotplug_oldest_intent_age_seconds"); n != 1 {
		t.Errorf("%d oldest-age series, want 1", n)
	}
	for range 2 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	if n := testutil.CollectAndCount(reg, "harvester_csi_hotplug_queue_depth"); n != 0 {
		t.Errorf("%d depth series after completion, want 0", n)
	}
	if got := testutil.ToFloat64(q.metrics.writes); got != 1 {
		t.Errorf("writes = %v, want 1 (one batch)", got)
	}
	if got := histogramCount(t, reg, "harvester_csi_hotplug_apply_duration_seconds"); got != 1 {
		t.Errorf("%d backend attempts timed, want 1", got)
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP harvester_csi_hotplug_batch_size Volume changes handed to the backend in one attempt.
# TYPE harvester_csi_hotplug_batch_size histogram
harvester_csi_hotplug_batch_size_bucket{backend="fake",le="1"} 0
harvester_csi_hotplug_batch_size_bucket{backend="fake",le="2"} 1
harvester_csi_hotplug_batch_size_bucket{backend="fake",le="4"} 1
harvester_csi_hotplug_batch_size_bucket{backend="fake",le="8"} 1
harvester_csi_hotplug_batch_size_bucket{backend="fake",le="16"} 1
harvester_csi_hotplug_batch_size_bucket{backend="fake",le="32"} 1
harvester_csi_hotplug_batch_size_bucket{backend="fake",le="64"} 1
harvester_csi_hotplug_batch_size_bucket{backend="fake",le="+Inf"} 1
harvester_csi_hotplug_batch_size_sum{backend="fake"} 2
harvester_csi_hotplug_batch_size_count{backend="fake"} 1
`), "harvester_csi_hotplug_batch_size"); err != nil {
		t.Error(err)
	}
}

func TestPublishedFollowsTheInformers(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1", "vm2")
	q, _ := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, a := range [][2]string{{"vm1", "pvc-a"}, {"vm1", "pvc-b"}, {"vm2", "pvc-c"}} {
		if err := q.Attach(ctx, a[0], a[1], true); err != nil {
			t.Fatal(err)
		}
	}
	want := map[string][]string{"pvc-a": {"vm1"}, "pvc-b": {"vm1"}, "pvc-c": {"vm2"}}
	if got := q.Published(); !reflect.DeepEqual(got, want) {
		t.Errorf("published %v, want %v", got, want)
	}
	if err := q.Detach(ctx, "vm1", "pvc-a"); err != nil {
		t.Fatal(err)
	}
	delete(want, "pvc-a")
	if got := q.Published(); !reflect.DeepEqual(got, want) {
		t.Errorf("after detach: published %v, want %v", got, want)
	}
}

func histogramCount(t *testing.T, reg *prometheus.Registry, name string) uint64 {
	t.Helper()
	n, _ := testmetrics.Histogram(t, reg, name, nil)
	return n
}

func histogramSum(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	_, sum := testmetrics.Histogram(t, reg, name, nil)
	return sum
}

// TestResultCountersStartAtZero: every change result is exported before it
// first happens, so alerts on increase() see the first rejection or host
// error after a start.
func TestResultCountersStartAtZero(t *testing.T) {
	_, reg := startQueue(t, newFakeKubeVirt(t, "vm1"), fastConfig())
	var want strings.Builder
	want.WriteString("# HELP harvester_csi_hotplug_change_results_total Outcomes of volume changes by kind (conflict, in_flight, already_done, rejected, ...).\n")
	want.WriteString("# TYPE harvester_csi_hotplug_change_results_total counter\n")
	for r := Applied; r <= Failed; r++ {
		fmt.Fprintf(&want, "harvester_csi_hotplug_change_results_total{backend=\"fake\",result=%q} 0\n", r)
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want.String()), "harvester_csi_hotplug_change_results_total"); err != nil {
		t.Error(err)
	}
}

// TestHeldTimeIsTheWaitBeforeTheWrite: the held histogram carries the part
// of an intent's time before its change was written (here the batch window),
// never more than the whole, so an operator can tell the queue's hold from
// KubeVirt's work.
func TestHeldTimeIsTheWaitBeforeTheWrite(t *testing.T) {
	cfg := windowConfig(300 * time.Millisecond)
	q, reg := startQueue(t, newFakeKubeVirt(t, "vm1"), cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := q.Attach(ctx, "vm1", "pvc-a", true); err != nil {
		t.Fatal(err)
	}
	held := histogramSum(t, reg, "harvester_csi_hotplug_intent_held_seconds")
	total := histogramSum(t, reg, "harvester_csi_hotplug_intent_duration_seconds")
	if held < cfg.BatchWindow.Seconds() || held > total {
		t.Errorf("held %.3fs of %.3fs, want at least the batch window (%v) and at most the whole", held, total, cfg.BatchWindow)
	}
}

func TestSplitOfAnIntentsTime(t *testing.T) {
	t0 := time.Unix(1000, 0)
	it := &intent{created: t0}
	if held, host := it.split(t0.Add(5 * time.Second)); held != 5*time.Second || host != 0 {
		t.Errorf("never written: held %v host %v, want 5s and 0", held, host)
	}
	it.written = t0.Add(2 * time.Second)
	if held, host := it.split(t0.Add(5 * time.Second)); held != 2*time.Second || host != 3*time.Second {
		t.Errorf("written after 2s: held %v host %v, want 2s and 3s", held, host)
	}
}

// A DetachBefore whose deadline passed before the batch is never written: its
// caller gets an ExpiredError and the volume stays. A caller without a
// deadline that wants the same detach is not held back by it.
func TestDetachBeforeIsNotWrittenAfterItsDeadline(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	q, _ := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	attachAll(ctx, t, q, "vm1", "pvc-a", "pvc-b")
	applies, _, _ := f.stats()
	var expired *ExpiredError
	if err := q.DetachBefore(ctx, "vm1", "pvc-a", time.Now().Add(-time.Millisecond)); !errors.As(err, &expired) {
		t.Fatalf("detach after its deadline answered %v, want an ExpiredError", err)
	}
	if got, _, _ := f.stats(); got != applies {
		t.Errorf("backend called %d more times for an expired detach, want 0", got-applies)
	}
	if !q.observe(q.key("vm1")).attached("pvc-a") {
		t.Error("pvc-a left the VM after its detach expired")
	}

	plain := make(chan error, 1)
	go func() { plain <- q.Detach(ctx, "vm1", "pvc-b") }()
	waitPending(t, q, "vm1", 1)
	if err := q.DetachBefore(ctx, "vm1", "pvc-b", time.Now().Add(-time.Millisecond)); err != nil {
		t.Errorf("expired detach joining a plain one answered %v, want nil", err)
	}
	if err := <-plain; err != nil {
		t.Errorf("plain detach: %v", err)
	}
	if q.observe(q.key("vm1")).attached("pvc-b") {
		t.Error("pvc-b is still on the VM")
	}
}

// A detach no caller asked for never undoes a publish in progress: while an
// attach of the volume to the VM is pending, DetachUnwantedBefore queues
// nothing and the attach goes on; once the attach is done and nothing of it
// is pending, the same call detaches.
func TestDetachUnwantedNeverTakesAPublishInProgress(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	cfg := fastConfig()
	cfg.BatchWindow = time.Second // the unwanted detach comes within it, even on a loaded machine
	q, _ := startQueue(t, f, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	attachErr := make(chan error, 1)
	go func() { attachErr <- q.Attach(ctx, "vm1", "pvc-a", true) }()
	waitPending(t, q, "vm1", 1) // its batch window is still open
	if err := q.DetachUnwantedBefore(ctx, "vm1", "pvc-a", time.Now().Add(time.Minute)); !errors.Is(err, ErrWanted) {
		t.Fatalf("unwanted detach during the attach answered %v, want ErrWanted", err)
	}
	if err := <-attachErr; err != nil {
		t.Fatalf("attach: %v", err)
	}
	if !q.observe(q.key("vm1")).attached("pvc-a") {
		t.Fatal("pvc-a is not on the VM after its attach")
	}
	if err := q.DetachUnwantedBefore(ctx, "vm1", "pvc-a", time.Now().Add(time.Minute)); err != nil {
		t.Fatalf("unwanted detach after the attach: %v", err)
	}
	if q.observe(q.key("vm1")).attached("pvc-a") {
		t.Error("pvc-a is still on the VM")
	}
}

// While the VMI names a second virt-launcher pod that may still run (a live
// migration, before its hand-off shows anywhere else), no hot-plug is
// written into the VM and the caller hears why; once a live read finds one
// of them ended, the change goes out, and the ended pod is remembered: the
// next attach reads no pods.
func TestNoHotplugIsWrittenIntoALiveMigration(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	ctx := context.Background()
	vmi, err := f.kv.KubevirtV1().VirtualMachineInstances(ns).Get(ctx, "vm1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vmi.Status.ActivePods = map[types.UID]string{"source": "harvester-0", "target": "harvester-1"}
	if _, err := f.kv.KubevirtV1().VirtualMachineInstances(ns).Update(ctx, vmi, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	f.setLaunchers("source", "target")
	q, _ := startQueue(t, f, fastConfig())

	short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	err = q.Attach(short, "vm1", "pvc-a", true)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "live migration (with virt-launcher pods on host nodes harvester-0 and harvester-1)") {
		t.Fatalf("attach during the migration answered %v, want DeadlineExceeded naming the migration", err)
	}
	if applies, _, _ := f.stats(); applies != 0 {
		t.Fatalf("%d writes into a migrating VM, want 0", applies)
	}

	f.setLaunchers("target") // the hand-off is done and the source ended
	long, cancel2 := context.WithTimeout(ctx, 10*time.Second)
	defer cancel2()
	if err := q.Attach(long, "vm1", "pvc-a", true); err != nil {
		t.Fatalf("attach after the migration: %v", err)
	}
	lists := f.requests().launcherLists
	if err := q.Attach(long, "vm1", "pvc-b", true); err != nil {
		t.Fatal(err)
	}
	if got := f.requests().launcherLists; got != lists {
		t.Errorf("%d more virt-launcher pod lists for an attach after the migration, want none: the ended source pod is known", got-lists)
	}
}

// An attach on its way when a live migration begins, its attachment pod
// not started, is withdrawn before the migration's hand-off (or the
// migration could never reach it) and written again once the migration
// ended; the caller only waits longer.
func TestAnAttachCaughtByAMigrationIsWithdrawnAndWrittenAgain(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	f.readyDelay = 3 * time.Second // KubeVirt is slow to plug: the migration begins meanwhile
	q, _ := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- q.Attach(ctx, "vm1", "pvc-a", true) }()
	testwait.Until(ctx, t, "the attach written", func() (bool, string) {
		_, writes, _ := f.stats()
		return writes == 1, fmt.Sprintf("%d writes", writes)
	})
	// The migration's target virt-launcher pod appears.
	vmi, err := f.kv.KubevirtV1().VirtualMachineInstances(ns).Get(ctx, "vm1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vmi.Status.ActivePods = map[types.UID]string{"source": "harvester-0", "target": "harvester-1"}
	f.setLaunchers("source", "target")
	f.vmiMu.Lock()
	_, err = f.kv.KubevirtV1().VirtualMachineInstances(ns).Update(ctx, vmi, metav1.UpdateOptions{})
	f.vmiMu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the attach withdrawn", func() (bool, string) {
		vm, err := f.kv.KubevirtV1().VirtualMachines(ns).Get(ctx, "vm1", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return !(observed{vm: vm}).inVMSpec("pvc-a"), "pvc-a still in the VM spec"
	})
	select {
	case err := <-done:
		t.Fatalf("attach answered %v while the migration ran", err)
	default:
	}
	f.setLaunchers("target") // the migration ended: the source pod is done
	if err := <-done; err != nil {
		t.Fatalf("attach after the migration: %v", err)
	}
	if _, writes, _ := f.stats(); writes != 3 {
		t.Errorf("%d VM writes, want 3: the add, its withdrawal, the add again", writes)
	}
}

// Removals queued on a VM that KubeVirt's VM controller does not take (it
// waits out the backoff its failed updates built up) are woken after
// MaxHold without progress, again only after another MaxHold, and the
// detach completes once the controller takes them.
func TestStalledLegacyRequestsWakeKubeVirtsVMController(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	ctx := context.Background()
	vms := f.kv.KubevirtV1().VirtualMachines(ns)
	vm, err := vms.Get(ctx, "vm1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	stalled := vmWith([]string{"pvc-a"}, removeReq("pvc-a"))
	vm.Spec.Template.Spec, vm.Status.VolumeRequests = stalled.Spec.Template.Spec, stalled.Status.VolumeRequests
	if _, err := vms.Update(ctx, vm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	vmis := f.kv.KubevirtV1().VirtualMachineInstances(ns)
	vmi, err := vmis.Get(ctx, "vm1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ready := vmiWith(map[string]kubevirtv1.VolumePhase{"pvc-a": kubevirtv1.VolumeReady})
	vmi.Spec.Volumes, vmi.Status.VolumeStatus = ready.Spec.Volumes, ready.Status.VolumeStatus
	if _, err := vmis.Update(ctx, vmi, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	cfg := fastConfig()
	cfg.MaxHold = 300 * time.Millisecond
	q, _ := startQueue(t, f, cfg)

	done := make(chan error, 1)
	go func() {
		dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		done <- q.Detach(dctx, "vm1", "pvc-a")
	}()
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	testwait.UntilEvery(wctx, t, 10*time.Millisecond, "two wakes of the VM controller", func() (bool, string) {
		n := f.requests().wakes
		return n >= 2, fmt.Sprintf("%d wakes", n)
	})
	got, err := vms.Get(ctx, "vm1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.Annotations["woken-at"] == "" || len(got.Status.VolumeRequests) != 1 || len(got.Spec.Template.Spec.Volumes) != 1 {
		t.Fatalf("the wake changed more than an annotation: %+v %+v", got.Annotations, got.Status.VolumeRequests)
	}
	if applies, _, _ := f.stats(); applies != 0 {
		t.Errorf("%d writes for a removal already queued, want 0", applies)
	}
	// Wakes come MaxHold apart: within 1.5 MaxHold of two, no third.
	time.Sleep(cfg.MaxHold / 2)
	if n := f.requests().wakes; n > 3 {
		t.Errorf("%d wakes within 1.5 MaxHold of the second, want at most one more", n-2)
	}

	// The controller takes the removal: the VM and VMI let go of the volume.
	got.Spec.Template.Spec = vmWith(nil).Spec.Template.Spec
	got.Status.VolumeRequests = nil
	if _, err := vms.Update(ctx, got, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	vmi, err = vmis.Get(ctx, "vm1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vmi.Spec.Volumes, vmi.Status.VolumeStatus = nil, nil
	if _, err := vmis.Update(ctx, vmi, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("detach: %v", err)
	}
	after := f.requests().wakes
	time.Sleep(2 * cfg.MaxHold)
	if n := f.requests().wakes; n != after {
		t.Errorf("%d wakes after the requests were taken, want none", n-after)
	}
}
