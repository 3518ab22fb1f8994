package guest

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

type fakeVMs struct {
	mu    sync.Mutex
	views map[string]hotplug.VMView
	// launchers names a virt-launcher pod the host still shows per VM.
	launchers map[string]string
	// readErr is the host's answer to the fresh read of a guest's state.
	readErr  error
	detached []string
}

func (f *fakeVMs) GuestStopped(_ context.Context, vm string) (bool, string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.readErr != nil {
		return false, "", f.readErr
	}
	if pod := f.launchers[vm]; pod != "" {
		return false, "virt-launcher pod " + pod + " may still run", nil
	}
	g := f.views[vm].Guest
	return g == hotplug.GuestAbsent || g == hotplug.GuestEnded, "VMI " + g.String(), nil
}

func (f *fakeVMs) DetachBefore(ctx context.Context, vm, volume string, _ time.Time) error {
	return f.Detach(ctx, vm, volume)
}

func (f *fakeVMs) Ready() bool { return true }

func (f *fakeVMs) View(vm string) hotplug.VMView {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.views[vm]
}

func (f *fakeVMs) Detach(_ context.Context, vm, volume string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.detached = append(f.detached, vm+"/"+volume)
	return nil
}

func readyNode(name string, ready corev1.ConditionStatus, tainted bool) *corev1.Node {
	n := guestNode(name)
	if ready != "" {
		n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: ready}}
	}
	n.Spec.Taints = []corev1.Taint{{Key: "keep-me", Effect: corev1.TaintEffectNoSchedule}}
	if tainted {
		n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{Key: corev1.TaintNodeOutOfService, Effect: corev1.TaintEffectNoExecute})
	}
	return n
}

// heldLease is the monitor's Lease as client-go writes it for holder.
func heldLease(holder string, renewed time.Time) *coordinationv1.Lease {
	return &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Namespace: DefaultLeaseNamespace, Name: DefaultLeaseName},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(holder), LeaseDurationSeconds: ptr.To[int32](15),
			AcquireTime: &metav1.MicroTime{Time: renewed}, RenewTime: &metav1.MicroTime{Time: renewed}},
	}
}

// Each decision of upstream's node controller, and the cases it must leave
// alone, on a guest Node whose name differs from its VM's.
func TestMonitorDecisions(t *testing.T) {
	running := hotplug.VMView{Exists: true, Running: true, Guest: hotplug.GuestRunning, Volumes: []string{"pvc-a"}}
	stopped := hotplug.VMView{Exists: true, Guest: hotplug.GuestAbsent, Volumes: []string{"pvc-a", "pvc-b"}}
	ended := hotplug.VMView{Exists: true, Guest: hotplug.GuestEnded, Volumes: []string{"pvc-a", "pvc-b"}}
	mayRun := hotplug.VMView{Exists: true, Guest: hotplug.GuestMayRun, Volumes: []string{"pvc-a", "pvc-b"}}
	refused := apierrors.NewForbidden(schema.GroupResource{Resource: "pods"}, "", errors.New("no list"))
	for _, tc := range []struct {
		name        string
		ready       corev1.ConditionStatus
		tainted     bool
		vm          hotplug.VMView
		launcher    string
		readErr     error
		wantTainted bool
		wantDetach  []string
	}{
		{name: "NotReady on a stopped VM is tainted", ready: corev1.ConditionFalse, vm: stopped, wantTainted: true},
		{name: "Unknown (kubelet silent) on a stopped VM is tainted", ready: corev1.ConditionUnknown, vm: stopped, wantTainted: true},
		{name: "tainted NotReady on a stopped VM loses its volumes", ready: corev1.ConditionFalse, tainted: true, vm: stopped, wantTainted: true, wantDetach: []string{"vm-1/pvc-a", "vm-1/pvc-b"}},
		{name: "Ready on a running VM loses the taint", ready: corev1.ConditionTrue, tainted: true, vm: running},
		{name: "NotReady on a running VM is left alone (a partition, not a dead VM)", ready: corev1.ConditionFalse, vm: running},
		{name: "tainted NotReady on a running VM keeps its taint and volumes", ready: corev1.ConditionFalse, tainted: true, vm: running, wantTainted: true},
		{name: "Ready on a stopped VM (stale status) is left alone", ready: corev1.ConditionTrue, vm: stopped},
		{name: "a Node whose VM the host does not show is left alone", ready: corev1.ConditionFalse, vm: hotplug.VMView{}},
		{name: "a Node without Ready condition is left alone", vm: stopped},
		{name: "NotReady on an ended VMI without launcher pod is tainted", ready: corev1.ConditionFalse, vm: ended, wantTainted: true},
		{name: "tainted NotReady on an ended VMI without launcher pod loses its volumes", ready: corev1.ConditionFalse, tainted: true, vm: ended, wantTainted: true, wantDetach: []string{"vm-1/pvc-a", "vm-1/pvc-b"}},
		{name: "NotReady on a VMI that may run (Unknown, paused, starting) is left alone", ready: corev1.ConditionUnknown, vm: mayRun},
		{name: "tainted NotReady on a VMI that may run keeps its volumes", ready: corev1.ConditionFalse, tainted: true, vm: mayRun, wantTainted: true},
		{name: "NotReady on an ended VMI whose launcher pod is still there is left alone", ready: corev1.ConditionFalse, vm: ended, launcher: "virt-launcher-vm-1-abcde"},
		{name: "tainted NotReady with a launcher pod still there keeps its volumes", ready: corev1.ConditionFalse, tainted: true, vm: stopped, launcher: "virt-launcher-vm-1-abcde", wantTainted: true},
		{name: "NotReady while the host refuses the pod read is left alone", ready: corev1.ConditionFalse, vm: stopped, readErr: refused},
		{name: "tainted NotReady while the host refuses the pod read keeps its volumes", ready: corev1.ConditionFalse, tainted: true, vm: stopped, readErr: refused, wantTainted: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			nodes, client := startNodes(t, readyNode("worker-1", tc.ready, tc.tainted), csiNode("worker-1", "vm-1"), heldLease("replica-a", time.Now()),
				guestPV("pvc-a"), guestPV("pvc-b"))
			vms := &fakeVMs{views: map[string]hotplug.VMView{"vm-1": tc.vm}, launchers: map[string]string{"vm-1": tc.launcher}, readErr: tc.readErr}
			ev := &fakeEvents{}
			m, err := NewMonitor(MonitorConfig{Identity: "replica-a"}, client, nodes, vms, ev)
			if err != nil {
				t.Fatal(err)
			}
			if err := m.sync(newTerm(ctx, func(error) {}), "worker-1"); err != nil {
				t.Fatal(err)
			}
			n, err := client.CoreV1().Nodes().Get(ctx, "worker-1", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if got := OutOfService(n); got != tc.wantTainted {
				t.Errorf("tainted = %v, want %v (taints %+v)", got, tc.wantTainted, n.Spec.Taints)
			}
			if !slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == "keep-me" }) {
				t.Errorf("another taint was lost: %+v", n.Spec.Taints)
			}
			if tc.wantTainted && !tc.tainted {
				i := slices.IndexFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == corev1.TaintNodeOutOfService })
				if got := n.Spec.Taints[i]; got.Value != "nodeshutdown" || got.TimeAdded == nil {
					t.Errorf("taint %+v, want node.kubernetes.io/out-of-service=nodeshutdown:NoExecute with its time", got)
				}
			}
			slices.Sort(vms.detached) // detached concurrently, in any order
			if !slices.Equal(vms.detached, tc.wantDetach) {
				t.Errorf("detached %v, want %v", vms.detached, tc.wantDetach)
			}
			changed := tc.wantTainted != tc.tainted || len(tc.wantDetach) > 0
			if got := ev.list(); changed != (len(got) == 1) || len(got) > 1 {
				t.Errorf("events %+v (a change gets one, nothing else any)", got)
			} else if changed && (got[0].node != "worker-1" || !strings.Contains(got[0].message, "vm-1")) {
				t.Errorf("event %+v does not name the VM on the node", got[0])
			}
		})
	}
}

// A replica that still believes it leads (its renewals are an hour apart, as
// for a process frozen between two of them) while the Lease already names
// another replica must not write: no taint, no untaint, no volume removed.
// Its term ends at its first check instead.
func TestMonitorDeposedNeverWrites(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	nodes, client := startNodes(t,
		readyNode("worker-1", corev1.ConditionTrue, false), csiNode("worker-1", "vm-1"), // would be tainted
		readyNode("worker-2", corev1.ConditionTrue, true), csiNode("worker-2", "vm-2"), // would lose its volumes
		readyNode("worker-3", corev1.ConditionFalse, true), csiNode("worker-3", "vm-3"), // would lose the taint
	)
	stopped := hotplug.VMView{Exists: true, Volumes: []string{"pvc-a"}}
	vms := &fakeVMs{views: map[string]hotplug.VMView{"vm-1": stopped, "vm-2": stopped,
		"vm-3": {Exists: true, Running: true, Guest: hotplug.GuestRunning}}}
	m, err := NewMonitor(MonitorConfig{Identity: "replica-a", LeaseDuration: 3 * time.Hour, RenewDeadline: 2 * time.Hour, RetryPeriod: time.Hour},
		client, nodes, vms, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Once replica-b has taken the lease, replica-a's writes of it fail (its
	// renewal, whether or not its first one is still on its way, and its
	// release), as they would on an API server after replica-b's update.
	var taken atomic.Bool
	client.PrependReactor("update", "leases", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if l := a.(k8stesting.UpdateAction).GetObject().(*coordinationv1.Lease); taken.Load() && ptr.Deref(l.Spec.HolderIdentity, "") != "replica-b" {
			return true, nil, apierrors.NewConflict(schema.GroupResource{Group: "coordination.k8s.io", Resource: "leases"}, l.Name, errors.New("taken"))
		}
		return false, nil, nil
	})
	runCtx, stopRun := context.WithCancel(ctx)
	ran := make(chan struct{})
	go func() { defer close(ran); _ = m.Run(runCtx) }()
	defer func() { stopRun(); <-ran }()
	testwait.Until(ctx, t, "replica-a leads", testwait.Bool(m.Leading))

	taken.Store(true)
	leases := client.CoordinationV1().Leases(DefaultLeaseNamespace)
	lease, err := leases.Get(ctx, DefaultLeaseName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	lease.Spec.HolderIdentity = ptr.To("replica-b")
	lease.Spec.RenewTime = &metav1.MicroTime{Time: time.Now()}
	if _, err := leases.Update(ctx, lease, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	client.ClearActions()
	for name, ready := range map[string]corev1.ConditionStatus{"worker-1": corev1.ConditionFalse, "worker-2": corev1.ConditionFalse, "worker-3": corev1.ConditionTrue} {
		n, err := client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: ready}}
		if _, err := client.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	nodeWrites := func() []string {
		var out []string
		for _, a := range client.Actions() {
			if a.GetResource().Resource == "nodes" && a.GetVerb() == "update" && a.GetSubresource() == "" {
				out = append(out, a.(k8stesting.UpdateAction).GetObject().(*corev1.Node).Name)
			}
		}
		return out
	}
	testwait.Until(ctx, t, "replica-a's term to end, or a write", func() (bool, string) {
		vms.mu.Lock()
		detached := len(vms.detached)
		vms.mu.Unlock()
		return !m.Leading() || len(nodeWrites()) > 0 || detached > 0, "still leading, nothing written"
	})
	if got := nodeWrites(); len(got) > 0 {
		t.Errorf("nodes %v written after the Lease named replica-b", got)
	}
	vms.mu.Lock()
	defer vms.mu.Unlock()
	if len(vms.detached) > 0 {
		t.Errorf("volumes %v removed after the Lease named replica-b", vms.detached)
	}
}

// The end of one term does not undo the start of the next: a term that
// outlives its successor's start (client-go starts the next term while the
// last one's workers are still stopping) leaves the successor's queue and
// leadership in place.
func TestMonitorTermEndKeepsTheNextTerm(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	nodes, client := startNodes(t, readyNode("worker-1", corev1.ConditionTrue, false), csiNode("worker-1", "vm-1"))
	vms := &fakeVMs{views: map[string]hotplug.VMView{"vm-1": {Exists: true, Running: true, Guest: hotplug.GuestRunning}}}
	m, err := NewMonitor(MonitorConfig{Identity: "replica-a"}, client, nodes, vms, nil)
	if err != nil {
		t.Fatal(err)
	}
	startTerm := func() (context.CancelFunc, <-chan struct{}) {
		tctx, end := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); m.lead(tctx, func(error) {}) }()
		return end, done
	}
	end1, done1 := startTerm()
	testwait.Until(ctx, t, "the first term", testwait.Bool(m.Leading))
	first := m.current.Load()
	end2, done2 := startTerm()
	defer func() { end2(); <-done2 }()
	testwait.Until(ctx, t, "the second term", func() (bool, string) { return m.current.Load() != first, "first term current" })
	second := m.current.Load()
	end1()
	<-done1
	if m.current.Load() != second || !m.Leading() {
		t.Fatalf("the first term's end cleared the second: current %p, want %p, leading %v", m.current.Load(), second, m.Leading())
	}
	if second.queue.ShuttingDown() {
		t.Error("the first term's end shut the second term's queue down")
	}
}

// Another guest cluster may share the host namespace: a Node tied to a VM
// by its name only, while its providerID names another VM, is not that
// VM's; and a fenced Node's VM releases only the volumes a guest PV of this
// cluster names.
func TestMonitorLeavesOtherClustersAlone(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	stopped := hotplug.VMView{Exists: true, Guest: hotplug.GuestAbsent, Volumes: []string{"pvc-theirs", "pvc-ours"}}
	namesake := readyNode("vm-2", corev1.ConditionFalse, false)
	namesake.Spec.ProviderID = ProviderIDPrefix + "uid-elsewhere"
	nodes, client := startNodes(t, readyNode("worker-1", corev1.ConditionFalse, true), csiNode("worker-1", "vm-1"),
		namesake, heldLease("replica-a", time.Now()), guestPV("pvc-ours"))
	nodes.SetVMUIDs(func(vm string) (types.UID, bool) { return types.UID("uid-" + vm), true })
	vms := &fakeVMs{views: map[string]hotplug.VMView{"vm-1": stopped, "vm-2": stopped}}
	m, err := NewMonitor(MonitorConfig{Identity: "replica-a"}, client, nodes, vms, nil)
	if err != nil {
		t.Fatal(err)
	}
	term := newTerm(ctx, func(error) {})
	for _, name := range []string{"worker-1", "vm-2"} {
		if err := m.sync(term, name); err != nil {
			t.Fatal(err)
		}
	}
	if !slices.Equal(vms.detached, []string{"vm-1/pvc-ours"}) {
		t.Errorf("detached %v, want only vm-1/pvc-ours", vms.detached)
	}
	n, err := client.CoreV1().Nodes().Get(ctx, "vm-2", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if OutOfService(n) {
		t.Error("a Node tied to another cluster's VM by its name only was tainted")
	}
}
