package hotplug

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// lagged delivers a watch's events d late (in order), as an informer behind
// a slow connection sees them.
func lagged(w watch.Interface, d time.Duration) watch.Interface {
	if w == nil || d <= 0 {
		return w
	}
	out := make(chan watch.Event)
	stop := make(chan struct{})
	lw := &lagWatch{inner: w, out: out, stop: stop}
	go func() {
		defer close(out)
		for ev := range w.ResultChan() {
			select {
			case <-time.After(d):
			case <-stop:
				return
			}
			select {
			case out <- ev:
			case <-stop:
				return
			}
		}
	}()
	return lw
}

type lagWatch struct {
	inner watch.Interface
	out   chan watch.Event
	stop  chan struct{}
	once  sync.Once
}

func (l *lagWatch) Stop() {
	l.once.Do(func() { close(l.stop); l.inner.Stop() })
}

func (l *lagWatch) ResultChan() <-chan watch.Event { return l.out }

// specHolders lists, from the fake API server itself, the VMs whose spec
// holds the volume.
func (f *fakeKubeVirt) specHolders(volume string) []string {
	l, err := f.kv.KubevirtV1().VirtualMachines(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	var out []string
	for i := range l.Items {
		if (observed{vm: &l.Items[i]}).inVMSpec(volume) {
			out = append(out, l.Items[i].Name)
		}
	}
	return out
}

// watchDoubleAttach fails the test if the volume is ever in two VMs' specs,
// polling the fake API server (not the lagging informers) until the test ends.
func watchDoubleAttach(t *testing.T, f *fakeKubeVirt, volume string) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			if h := f.specHolders(volume); len(h) > 1 {
				t.Errorf("volume %s is in the spec of %v at once", volume, h)
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
}

func TestCallsBeforeTheCachesSyncAreRefused(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	vms := f.kv.KubevirtV1().VirtualMachines(ns)
	vm, _ := vms.Get(context.Background(), "vm1", metav1.GetOptions{})
	vm.Spec.Template.Spec = vmWith([]string{"pvc-a"}).Spec.Template.Spec
	if _, err := vms.Update(context.Background(), vm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Informers that never sync: the queue must not take their empty cache
	// for "nothing is attached".
	vmInf := cache.NewSharedIndexInformer(&cache.ListWatch{}, &kubevirtv1.VirtualMachine{}, 0, cache.Indexers{})
	vmiInf := cache.NewSharedIndexInformer(&cache.ListWatch{}, &kubevirtv1.VirtualMachineInstance{}, 0, cache.Indexers{})
	q, err := New(Config{Namespace: ns}, f, f, vmInf, vmiInf, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	go func() { _ = q.Run(ctx) }()
	if err := q.Detach(ctx, "vm1", "pvc-a"); !errors.Is(err, ErrNotReady) {
		t.Errorf("detach before sync answered %v, want ErrNotReady", err)
	}
	if err := q.Attach(ctx, "vm1", "pvc-b", true); !errors.Is(err, ErrNotReady) {
		t.Errorf("attach before sync answered %v, want ErrNotReady", err)
	}
	if q.Ready() {
		t.Error("queue reports ready before its informers synced")
	}
	if applies, _, _ := f.stats(); applies != 0 {
		t.Errorf("%d backend calls before sync, want 0", applies)
	}
}

// detectingBackend learns its name only when start is closed, as a backend
// does that asks the host which hotplug path it expects.
type detectingBackend struct {
	*fakeKubeVirt
	start chan struct{}
	name  atomic.Pointer[string]
}

func (d *detectingBackend) Start(ctx context.Context, progress func(string)) error {
	progress("the host does not answer")
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-d.start:
	}
	name := "detected"
	d.name.Store(&name)
	return nil
}

func (d *detectingBackend) Name() string {
	if n := d.name.Load(); n != nil {
		return *n
	}
	return ""
}

// Until the backend knows the host's hotplug path the queue does not run:
// callers are refused, nothing is written, and it says why; its metrics then
// carry the name the backend learned.
func TestCallsBeforeTheBackendStartsAreRefused(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	b := &detectingBackend{fakeKubeVirt: f, start: make(chan struct{})}
	vms := f.kv.KubevirtV1().VirtualMachines(ns)
	vmis := f.kv.KubevirtV1().VirtualMachineInstances(ns)
	vmInf := cache.NewSharedIndexInformer(&cache.ListWatch{
		ListWithContextFunc:  func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return vms.List(ctx, o) },
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) { return vms.Watch(ctx, o) },
	}, &kubevirtv1.VirtualMachine{}, 0, cache.Indexers{})
	vmiInf := cache.NewSharedIndexInformer(&cache.ListWatch{
		ListWithContextFunc:  func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return vmis.List(ctx, o) },
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) { return vmis.Watch(ctx, o) },
	}, &kubevirtv1.VirtualMachineInstance{}, 0, cache.Indexers{})
	reg := prometheus.NewRegistry()
	q, err := New(Config{Namespace: ns}, b, f, vmInf, vmiInf, reg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	go vmInf.RunWithContext(ctx)
	go vmiInf.RunWithContext(ctx)
	go func() { _ = q.Run(ctx) }()
	testwait.Until(ctx, t, "the queue to say the backend is detecting", func() (bool, string) {
		why := q.Waiting()
		return why == "detecting the hotplug backend: the host does not answer", why
	})
	if !cache.WaitForCacheSync(ctx.Done(), vmInf.HasSynced, vmiInf.HasSynced) {
		t.Fatal("informers did not sync")
	}
	if q.Ready() {
		t.Error("queue ready before its backend started")
	}
	if err := q.Attach(ctx, "vm1", "pvc-a", true); !errors.Is(err, ErrNotReady) {
		t.Errorf("attach before the backend started answered %v, want ErrNotReady", err)
	}
	close(b.start)
	testwait.Until(ctx, t, "the queue to run", func() (bool, string) { return q.Ready(), q.Waiting() })
	if applies, _, _ := f.stats(); applies != 0 {
		t.Errorf("%d backend calls before the backend started, want 0", applies)
	}
	if err := q.Attach(ctx, "vm1", "pvc-a", true); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(q.metrics.writes); got != 1 {
		t.Errorf("%v VM writes counted, want 1", got)
	}
	if n := testutil.CollectAndCount(reg, "harvester_csi_hotplug_vm_writes_total"); n != 1 {
		t.Errorf("%d VM write series, want 1", n)
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP harvester_csi_hotplug_vm_writes_total Backend attempts that changed a VM's hotplug set.
# TYPE harvester_csi_hotplug_vm_writes_total counter
harvester_csi_hotplug_vm_writes_total{backend="detected"} 1
`), "harvester_csi_hotplug_vm_writes_total"); err != nil {
		t.Error(err)
	}
}

// An attach written but not yet visible in the informers, superseded by a
// detach, must still fence the volume: the write may land at any moment.
func TestUnobservedWriteFencesTheVolume(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1", "vm2")
	f.lag = 500 * time.Millisecond
	f.readyDelay = 100 * time.Millisecond
	q, _ := startQueue(t, f, fastConfig())
	watchDoubleAttach(t, f, "pvc-a")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	attached := make(chan error, 1)
	go func() { attached <- q.Attach(ctx, "vm1", "pvc-a", true) }()
	// Every millisecond: the detach must come before the informers show
	// the write.
	written, cancelWritten := context.WithTimeout(ctx, 5*time.Second)
	defer cancelWritten()
	testwait.UntilEvery(written, t, time.Millisecond, "the attach to vm1 to be written", func() (bool, string) {
		return slices.Contains(f.specHolders("pvc-a"), "vm1"), fmt.Sprintf("spec holders %v", f.specHolders("pvc-a"))
	})
	detached := make(chan error, 1)
	go func() { detached <- q.Detach(ctx, "vm1", "pvc-a") }()
	waitIntent(t, q, "vm1", "pvc-a", Detach)

	// The attach to vm2 waits for our detach from vm1, which ends only
	// once the informers show the write landed and was undone
	// (watchDoubleAttach fails the test on any overlap).
	if err := q.Attach(ctx, "vm2", "pvc-a", true); err != nil {
		t.Fatalf("attach to vm2 while vm1's write is unobserved: %v", err)
	}
	if err := <-detached; err != nil {
		t.Fatalf("detach from vm1: %v", err)
	}
	var superseded *SupersededError
	if err := <-attached; !errors.As(err, &superseded) {
		t.Fatalf("first attach answered %v, want superseded", err)
	}
}

// An exclusive attach of a volume this process is detaching from another
// VM waits for that detach instead of answering "held": the caller would
// otherwise come back only after its own backoff, seconds after the volume
// is free. A caller that gives up first is told what it waited for.
func TestAttachWaitsForOurDetachFromAnotherVM(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1", "vm2")
	f.readyDelay = 300 * time.Millisecond
	q, _ := startQueue(t, f, fastConfig())
	watchDoubleAttach(t, f, "pvc-a")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := q.Attach(ctx, "vm1", "pvc-a", true); err != nil {
		t.Fatal(err)
	}
	detached := make(chan error, 1)
	go func() { detached <- q.Detach(ctx, "vm1", "pvc-a") }()
	waitIntent(t, q, "vm1", "pvc-a", Detach)

	short, cancelShort := context.WithTimeout(ctx, time.Millisecond)
	defer cancelShort()
	if err := q.Attach(short, "vm2", "pvc-a", true); !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "detach from VM vm1") {
		t.Fatalf("attach to vm2 with a caller gone at once answered %v, want its deadline while waiting for the detach from vm1", err)
	}
	if err := q.Attach(ctx, "vm2", "pvc-a", true); err != nil {
		t.Fatalf("attach to vm2 while vm1 lets go: %v", err)
	}
	if err := <-detached; err != nil {
		t.Fatalf("detach from vm1: %v", err)
	}
	if h := f.specHolders("pvc-a"); !slices.Equal(h, []string{"vm2"}) {
		t.Fatalf("volume held by %v, want only vm2", h)
	}
}

// Another writer (a controller that lost its lease and does not know yet)
// puts the volume on vm2; our informers have not seen it. The attach to vm1
// must be refused from the API server's answer, right before the write.
func TestExclusiveAttachIsCheckedAgainstTheAPIServerBeforeTheWrite(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1", "vm2")
	f.lag = time.Second
	q, _ := startQueue(t, f, fastConfig())
	watchDoubleAttach(t, f, "pvc-a")
	vms := f.kv.KubevirtV1().VirtualMachines(ns)
	vm2, _ := vms.Get(context.Background(), "vm2", metav1.GetOptions{})
	vm2.Spec.Template.Spec = vmWith([]string{"pvc-a"}).Spec.Template.Spec
	if _, err := vms.Update(context.Background(), vm2, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var held *HeldError
	if err := q.Attach(ctx, "vm1", "pvc-a", true); !errors.As(err, &held) || held.VM != "vm2" {
		t.Fatalf("attach to vm1 answered %v, want a HeldError naming vm2", err)
	}
	if h := f.specHolders("pvc-a"); !slices.Equal(h, []string{"vm2"}) {
		t.Fatalf("volume held by %v, want only vm2", h)
	}
}

// A host that refuses the driver's identity must reach the caller as that
// refusal, at once, not as "still in progress" at the deadline.
func TestPermanentFailureReachesTheCaller(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	forbidden := apierrors.NewForbidden(schema.GroupResource{Group: "kubevirt.io", Resource: "virtualmachines"}, "vm1",
		errors.New(`User "system:serviceaccount:guests:csi" cannot patch resource "virtualmachines"`))
	f.override = func(string, Change) (Outcome, bool) { return Outcome{Result: Failed, Err: forbidden}, true }
	q, _ := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := time.Now()
	err := q.Attach(ctx, "vm1", "pvc-a", true)
	var stalled *StalledError
	if !errors.As(err, &stalled) || !apierrors.IsForbidden(err) {
		t.Fatalf("attach answered %v, want a StalledError carrying the host's Forbidden", err)
	}
	if ctx.Err() != nil || time.Since(start) > 30*time.Second {
		t.Fatalf("answered only after %v (ctx: %v): a refusal that retrying cannot cure must not wait for the deadline", time.Since(start), ctx.Err())
	}
	// The intent stays for the retry, which gets the same answer.
	if err := q.Attach(ctx, "vm1", "pvc-a", true); !apierrors.IsForbidden(err) {
		t.Fatalf("retry answered %v, want Forbidden", err)
	}
}

// A transient failure (the host API does not answer) is retried; a caller
// whose deadline comes first learns why it waited.
func TestDeadlineAnswerNamesTheLastFailure(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	f.override = func(string, Change) (Outcome, bool) {
		return Outcome{Result: Failed, Err: fmt.Errorf("dial tcp 10.0.0.1:6443: connect: connection refused")}, true
	}
	q, _ := startQueue(t, f, fastConfig())
	// The caller gives up once an attempt has failed, not after a fixed time:
	// on a busy machine the first attempt can come late.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	answer := make(chan error, 1)
	go func() { answer <- q.Attach(ctx, "vm1", "pvc-a", true) }()
	testwait.For(t, "a failed attempt", 30*time.Second, func() bool {
		return testutil.ToFloat64(q.metrics.hostFailures.WithLabelValues(causeUnavailable)) >= 1
	})
	cancel()
	err := <-answer
	var stalled *StalledError
	if !errors.As(err, &stalled) {
		t.Fatalf("attach answered %v, want a StalledError when the caller gives up", err)
	}
	if want := "connection refused"; !strings.Contains(err.Error(), want) {
		t.Fatalf("answer %q does not name the cause %q", err, want)
	}
}

func waitIntent(t *testing.T, q *Queue, vm, volume string, op Op) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// Every millisecond: the test acts while the intent is pending.
	testwait.UntilEvery(ctx, t, time.Millisecond, fmt.Sprintf("a %s intent for %s on %s", op, volume, vm), func() (bool, string) {
		q.mu.Lock()
		defer q.mu.Unlock()
		if w := q.work[q.key(vm)]; w != nil && w.intents[volume] != nil {
			got := w.intents[volume].op
			return got == op, fmt.Sprintf("a %s intent", got)
		}
		return false, "no intent"
	})
}

// A caller whose deadline comes while KubeVirt is still at work learns what
// the volume waits for, and for how long, not only "in progress".
func TestDeadlineAnswerSaysWhatItWaitsFor(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	f.readyDelay = time.Hour // the VMI never follows
	q, _ := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	err := q.Attach(ctx, "vm1", "pvc-a", true)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "waiting for KubeVirt to plug the volume") {
		t.Fatalf("attach answered %v, want a deadline that says it waits for KubeVirt to plug the volume", err)
	}
}

// A claim that is gone or not Bound when its attach is about to be written is
// never written: KubeVirt would stall every new volume of the VM on it. The
// other volumes of the batch go on.
func TestClaimsThatAreNotBoundAreNeverHotplugged(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	f.claims = map[string]corev1.PersistentVolumeClaimPhase{"pvc-gone": "", "pvc-pending": corev1.ClaimPending}
	q, _ := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	errs := make(chan error, 3)
	for _, vol := range []string{"pvc-gone", "pvc-pending", "pvc-ok"} {
		go func() { errs <- q.Attach(ctx, "vm1", vol, true) }()
	}
	var notReady, ok int
	for range 3 {
		var cnr *ClaimNotReadyError
		switch err := <-errs; {
		case err == nil:
			ok++
		case errors.As(err, &cnr):
			notReady++
		default:
			t.Errorf("unexpected answer %v", err)
		}
	}
	if ok != 1 || notReady != 2 {
		t.Fatalf("%d attached, %d refused as not ready; want 1 and 2", ok, notReady)
	}
	for _, vol := range []string{"pvc-gone", "pvc-pending"} {
		if h := f.specHolders(vol); len(h) > 0 {
			t.Errorf("%s was written to %v", vol, h)
		}
	}
}

// State shows an operator what each VM's intents wait for and why they fail.
func TestStateSaysWhatEachIntentWaitsFor(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	f.override = func(string, Change) (Outcome, bool) {
		return Outcome{Result: Failed, Err: errors.New("dial tcp: connection refused")}, true
	}
	q, _ := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	go func() { _ = q.Attach(ctx, "vm1", "pvc-a", true) }()
	failing, cancelFailing := context.WithTimeout(ctx, 5*time.Second)
	defer cancelFailing()
	testwait.Until(failing, t, "the state to show the failing attach", func() (bool, string) {
		st := q.State()
		if len(st) == 1 && strings.Contains(st[0].LastError, "connection refused") && len(st[0].Intents) == 1 {
			if st[0].VM != "vm1" || st[0].Intents[0].Volume != "pvc-a" || st[0].Intents[0].Op != Attach || st[0].FailingSince.IsZero() {
				t.Fatalf("state %+v", st)
			}
			return true, ""
		}
		return false, fmt.Sprintf("%+v", st)
	})
}

// An attach the API server refused because it could not call an admission
// webhook (failurePolicy Fail; Harvester's while an upgrade restarts it) was
// not stored: it leaves no expectation behind, so a detach that replaces it
// is done at once and the volume can go to another VM, instead of counting
// as held by the first VM until MaxHold.
func TestWebhookCallFailureWritesNothing(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1", "vm2")
	f.override = func(vm string, c Change) (Outcome, bool) {
		if vm == "vm1" && c.Op == Attach {
			return Outcome{Result: Failed, Err: apierrors.NewInternalError(errors.New(`failed calling webhook "validator.harvesterhci.io": failed to call webhook: Post "https://harvester-webhook.harvester-system.svc:443/v1/webhook/validation?timeout=10s": dial tcp 10.53.0.9:443: connect: connection refused`))}, true
		}
		return Outcome{}, false
	}
	cfg := fastConfig()
	cfg.MaxHold = time.Hour
	q, _ := startQueue(t, f, cfg)
	caller, giveUp := context.WithCancel(context.Background())
	answer := make(chan error, 1)
	go func() { answer <- q.Attach(caller, "vm1", "pvc-a", true) }()
	testwait.For(t, "a failed attempt", 30*time.Second, func() bool {
		return testutil.ToFloat64(q.metrics.hostFailures.WithLabelValues(causeOther)) >= 1
	})
	giveUp()
	if err := <-answer; !strings.Contains(fmt.Sprint(err), "failed calling webhook") {
		t.Fatalf("attach answered %v, want the webhook failure as its cause", err)
	}
	// Bounded far below MaxHold: the detach must not wait for a write that
	// never happened.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := q.Detach(ctx, "vm1", "pvc-a"); err != nil {
		t.Fatalf("detach replacing the refused attach: %v", err)
	}
	if err := q.Attach(ctx, "vm2", "pvc-a", true); err != nil {
		t.Fatalf("attach to vm2 after vm1's refused attach was withdrawn: %v", err)
	}
}
