package guest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// The lease upstream's node controller is elected under, so that during an
// upgrade from the upstream chart only one of them fences nodes.
const (
	DefaultLeaseNamespace = "kube-system"
	DefaultLeaseName      = "harvester-csi-node-monitor"
)

// VMs is what the monitor needs of the host side: the informers' view of a
// VM, a fresh read of whether its guest is stopped, and the hotplug queue,
// through which every volume leaves a VM.
type VMs interface {
	// Ready reports whether the host's VM and VMI caches are filled; until
	// then every VM would look stopped.
	Ready() bool
	View(vm string) hotplug.VMView
	// GuestStopped reads the VM's VMI and virt-launcher pods from the host
	// API server and reports whether the guest is known to be stopped, and
	// what decided it.
	GuestStopped(ctx context.Context, vm string) (stopped bool, why string, err error)
	// DetachBefore removes the volume from the VM through the hotplug
	// queue; the change is written only before deadline.
	DetachBefore(ctx context.Context, vm, volume string, deadline time.Time) error
}

// MonitorConfig tunes the monitor. Zero fields take the defaults noted.
type MonitorConfig struct {
	// LeaseNamespace and LeaseName locate the election's Lease
	// (kube-system/harvester-csi-node-monitor).
	LeaseNamespace, LeaseName string
	// Identity names this replica in the Lease (hostname and a random
	// suffix).
	Identity string
	// LeaseDuration, RenewDeadline and RetryPeriod are client-go's leader
	// election timings (15s, 10s, 2s).
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// DetachTimeout bounds one pass's wait for a fenced node's volumes to
	// leave its VM (2 min); a pass that runs out is retried.
	DetachTimeout time.Duration
	// Workers is how many Nodes are handled at once (2).
	Workers int
	// FencingOff leaves guest Nodes alone (--node-monitor=false): the
	// election then runs for the orphan reconciler only.
	FencingOff bool
}

func (c MonitorConfig) withDefaults() MonitorConfig {
	if c.LeaseNamespace == "" {
		c.LeaseNamespace = DefaultLeaseNamespace
	}
	if c.LeaseName == "" {
		c.LeaseName = DefaultLeaseName
	}
	if c.Identity == "" {
		host, _ := os.Hostname()
		c.Identity = host + "_" + rand.String(8)
	}
	for _, d := range []struct {
		v *time.Duration
		d time.Duration
	}{{&c.LeaseDuration, 15 * time.Second}, {&c.RenewDeadline, 10 * time.Second}, {&c.RetryPeriod, 2 * time.Second}, {&c.DetachTimeout, 2 * time.Minute}} {
		if *d.v <= 0 {
			*d.v = d.d
		}
	}
	if c.Workers <= 0 {
		c.Workers = 2
	}
	return c
}

// Monitor is upstream's guest node controller: on the elected replica only,
// a guest Node that is NotReady while its VM's guest is known to be stopped
// is tainted out of service (Kubernetes then force-deletes its pods and
// detaches their volumes at once); the hotplug volumes of a Node so tainted
// are removed from its VM through the hotplug queue; a Ready Node on a
// running VM loses the taint. A guest that may be alive (VMI Unknown, paused,
// starting, or a launcher pod still there) is never fenced, and a Node whose
// VM the host does not show is left alone: it may be no VM of this cluster's
// host at all. Every write is preceded by a read of the Lease that shows this
// replica still holds it.
type Monitor struct {
	cfg    MonitorConfig
	client kubernetes.Interface
	nodes  *Nodes
	vms    VMs
	events EventSink
	// orphans, when set, runs in every term beside the Node workers.
	orphans *Orphans

	// current is the term this replica leads in, nil between terms. All
	// per-term state lives in the term, and a term clears current only if
	// it is still its own, so the end of one term cannot undo the start
	// of the next.
	current atomic.Pointer[term]
	// hostRefusalLogged keeps a refused host read at one error line.
	hostRefusalLogged atomic.Bool
}

// term is one stretch of leadership: its context ends when client-go stops
// renewing or when a check before a write finds another holder, and its
// queue goes with it, dropping what was queued in it.
type term struct {
	ctx   context.Context
	end   context.CancelCauseFunc
	queue workqueue.TypedRateLimitingInterface[string]
}

// errDeposed is the cause of a term ended by a check that found another
// holder in the Lease.
var errDeposed = errors.New("the lease names another holder")

// newTerm starts a term under the election context ctx; ending it also
// ends stopElection's election, so that client-go does not keep renewing a
// lease this replica no longer works under.
func newTerm(ctx context.Context, stopElection context.CancelCauseFunc) *term {
	tctx, cancel := context.WithCancelCause(ctx)
	return &term{
		ctx: tctx,
		end: func(cause error) { cancel(cause); stopElection(cause) },
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](time.Second, time.Minute),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "guest-node-monitor"}),
	}
}

// NewMonitor builds the monitor; Run elects and works. events may be nil.
func NewMonitor(cfg MonitorConfig, client kubernetes.Interface, nodes *Nodes, vms VMs, events EventSink) (*Monitor, error) {
	m := &Monitor{cfg: cfg.withDefaults(), client: client, nodes: nodes, vms: vms, events: events}
	err := nodes.AddNodeHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    m.enqueueObj,
		UpdateFunc: func(_, obj any) { m.enqueueObj(obj) },
	})
	return m, err
}

// SetOrphans has the orphan reconciler run in this monitor's terms, under
// its Lease and with its check before each write. Call before Run.
func (m *Monitor) SetOrphans(o *Orphans) { m.orphans = o }

// Leading reports whether this replica works a term now.
func (m *Monitor) Leading() bool { return m.working() != nil }

// working is the current term, nil when there is none or it has ended.
func (m *Monitor) working() *term {
	if t := m.current.Load(); t != nil && t.ctx.Err() == nil {
		return t
	}
	return nil
}

// Identity is this replica's name in the Lease.
func (m *Monitor) Identity() string { return m.cfg.Identity }

// VMChanged looks again at the guest Nodes of a VM whose VM or VMI changed:
// a VM that stops after its Node went NotReady changes no Node.
func (m *Monitor) VMChanged(vm string) {
	t := m.working()
	if t == nil {
		return
	}
	for _, n := range m.nodes.NodesOfVM(vm) {
		t.queue.Add(n.Name)
	}
}

func (m *Monitor) enqueueObj(obj any) {
	if t := m.working(); t != nil {
		if n, ok := obj.(*corev1.Node); ok {
			t.queue.Add(n.Name)
		}
	}
}

// Run takes part in the election until ctx ends, working while it leads.
func (m *Monitor) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithValues("lease", m.cfg.LeaseNamespace+"/"+m.cfg.LeaseName, "identity", m.cfg.Identity)
	ctx = klog.NewContext(ctx, logger)
	for ctx.Err() == nil {
		electionCtx, stopElection := context.WithCancelCause(ctx)
		le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
			Lock: &resourcelock.LeaseLock{
				LeaseMeta:  metav1.ObjectMeta{Namespace: m.cfg.LeaseNamespace, Name: m.cfg.LeaseName},
				Client:     m.client.CoordinationV1(),
				LockConfig: resourcelock.ResourceLockConfig{Identity: m.cfg.Identity},
			},
			LeaseDuration:   m.cfg.LeaseDuration,
			RenewDeadline:   m.cfg.RenewDeadline,
			RetryPeriod:     m.cfg.RetryPeriod,
			ReleaseOnCancel: true,
			Name:            m.cfg.LeaseName,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(ctx context.Context) { m.lead(ctx, stopElection) },
				OnStoppedLeading: func() {
					logger.Info("guest node monitor: no longer leading", "cause", context.Cause(electionCtx))
				},
			},
		})
		if err != nil {
			stopElection(nil)
			return err
		}
		le.Run(electionCtx)
		stopElection(nil)
	}
	return nil
}

// lead works the monitor for one term.
func (m *Monitor) lead(ctx context.Context, stopElection context.CancelCauseFunc) {
	logger := klog.FromContext(ctx)
	logger.Info("guest node monitor: leading")
	t := newTerm(ctx, stopElection)
	defer t.queue.ShutDown()
	// Decide nothing before both sides are cached: an empty VMI cache says
	// every VM is stopped.
	if !cache.WaitForCacheSync(t.ctx.Done(), m.nodes.HasSynced, m.vms.Ready) {
		return
	}
	m.current.Store(t)
	defer m.current.CompareAndSwap(t, nil)
	var wg sync.WaitGroup
	if m.orphans != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m.orphans.run(t.ctx, func(ctx context.Context) (time.Time, error) { return m.confirm(ctx, t) })
		}()
	}
	workers := m.cfg.Workers
	if m.cfg.FencingOff {
		workers = 0
	}
	for _, name := range m.nodes.nodes.GetStore().ListKeys() {
		t.queue.Add(name)
	}
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m.next(t) {
			}
		}()
	}
	<-t.ctx.Done()
	t.queue.ShutDown()
	wg.Wait()
}

func (m *Monitor) next(t *term) bool {
	name, quit := t.queue.Get()
	if quit {
		return false
	}
	defer t.queue.Done(name)
	if t.ctx.Err() != nil {
		// A shut-down queue still hands out what it holds; the term that
		// queued it is over, so it is dropped.
		return false
	}
	err := m.sync(t, name)
	switch {
	case errors.Is(err, errDeposed):
		return false
	case err != nil:
		klog.FromContext(t.ctx).Error(err, "guest node monitor: will retry", "node", name)
		t.queue.AddRateLimited(name)
	default:
		t.queue.Forget(name)
	}
	return true
}

// sync takes the one decision the Node and its VM call for. The caches only
// say which decision may be due; that a guest is stopped is read afresh from
// the host, and that this replica still leads from the Lease, right before
// the write.
func (m *Monitor) sync(t *term, name string) error {
	node, ok := m.nodes.Node(name)
	if !ok || node.DeletionTimestamp != nil {
		return nil
	}
	ready, known := nodeReady(node)
	vm := m.nodes.VMOfNode(name)
	logger := klog.FromContext(t.ctx).WithValues("node", name, "vm", vm)
	ctx := klog.NewContext(t.ctx, logger)
	if !known {
		return nil // kubelet has not reported yet
	}
	view := m.vms.View(vm)
	if !view.Exists {
		logger.V(3).Info("no VM of that name on the host: not monitored")
		return nil
	}
	if !slices.ContainsFunc(m.nodes.NodesOfVM(vm), func(n *corev1.Node) bool { return n.Name == name }) {
		// Only its name ties the Node to the VM, and its providerID says
		// otherwise: the VM may be another guest cluster's.
		logger.V(2).Info("the Node is not known to run this VM: not monitored")
		return nil
	}
	tainted := OutOfService(node)
	switch {
	case ready && view.Guest == hotplug.GuestRunning && tainted:
		return m.untaint(ctx, t, node, vm)
	case ready:
		return nil
	case view.Guest != hotplug.GuestAbsent && view.Guest != hotplug.GuestEnded:
		logger.V(3).Info("guest node NotReady, but its guest may be running: left alone", "guest", view.Guest.String())
		return nil
	case tainted && len(view.Volumes) == 0:
		return nil // fenced, and nothing left to release
	}
	stopped, why, err := m.vms.GuestStopped(ctx, vm)
	if err != nil {
		return m.hostReadFailed(ctx, err)
	}
	if !stopped {
		logger.V(2).Info("guest node NotReady, but its guest may be running: left alone", "why", why)
		return nil
	}
	if tainted {
		volumes, err := m.owned(ctx, view.Volumes)
		if err != nil {
			return err
		}
		return m.release(ctx, t, node, vm, volumes, why)
	}
	return m.taint(ctx, t, node, vm, why)
}

// hostReadFailed handles a failed fresh read of the guest's state: nothing is
// fenced without it. A refusal (the host identity lacks the pod read) is
// said once as an error, and the Node is left alone; anything else is
// retried.
func (m *Monitor) hostReadFailed(ctx context.Context, err error) error {
	if !apierrors.IsForbidden(err) && !apierrors.IsUnauthorized(err) {
		return fmt.Errorf("read whether the guest is stopped: %w", err)
	}
	logger := klog.FromContext(ctx)
	if m.hostRefusalLogged.CompareAndSwap(false, true) {
		logger.Error(err, "guest node monitor: the host refuses the read of VMIs or virt-launcher pods, so no guest Node is fenced (grant it: docs/host-rbac.md)")
	} else {
		logger.V(2).Info("host read refused: node left alone", "err", err.Error())
	}
	return nil
}

// confirm reads the Lease from the API server (a quorum read) right before a
// write and returns until when the write may leave this process: this
// replica's last renewal plus the lease duration. The renew time was
// written with this process's own clock, and no other replica takes the
// lease before it has seen that renewal unchanged for the lease duration.
// Another holder ends the term.
func (m *Monitor) confirm(ctx context.Context, t *term) (time.Time, error) {
	lease, err := m.client.CoordinationV1().Leases(m.cfg.LeaseNamespace).Get(ctx, m.cfg.LeaseName, metav1.GetOptions{})
	if err != nil {
		return time.Time{}, fmt.Errorf("confirm the lease before writing: %w", err)
	}
	if holder := ptr.Deref(lease.Spec.HolderIdentity, ""); holder != m.cfg.Identity {
		err := fmt.Errorf("lease %s/%s held by %q: %w", m.cfg.LeaseNamespace, m.cfg.LeaseName, holder, errDeposed)
		klog.FromContext(ctx).Info("guest node monitor: deposed, term ended before writing", "holder", holder)
		t.end(err)
		return time.Time{}, err
	}
	if lease.Spec.RenewTime == nil || lease.Spec.LeaseDurationSeconds == nil {
		return time.Time{}, fmt.Errorf("lease %s/%s has no renew time or duration: not writing", m.cfg.LeaseNamespace, m.cfg.LeaseName)
	}
	until := lease.Spec.RenewTime.Add(time.Duration(*lease.Spec.LeaseDurationSeconds) * time.Second)
	if !time.Now().Before(until) {
		return time.Time{}, fmt.Errorf("lease %s/%s last renewed at %s, expired at %s: not writing",
			m.cfg.LeaseNamespace, m.cfg.LeaseName, lease.Spec.RenewTime.UTC().Format(time.RFC3339Nano), until.UTC().Format(time.RFC3339Nano))
	}
	return until, nil
}

// updateNode writes the Node after confirming the lease, with the lease's
// end as the request's deadline.
func (m *Monitor) updateNode(ctx context.Context, t *term, node *corev1.Node) error {
	until, err := m.confirm(ctx, t)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithDeadline(ctx, until)
	defer cancel()
	_, err = m.client.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{})
	return err
}

func nodeReady(node *corev1.Node) (ready, known bool) {
	for _, c := range node.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue, true
		}
	}
	return false, false
}

func (m *Monitor) taint(ctx context.Context, t *term, node *corev1.Node, vm, why string) error {
	upd := node.DeepCopy()
	taint := OutOfServiceTaint
	now := metav1.Now()
	taint.TimeAdded = &now
	upd.Spec.Taints = append(upd.Spec.Taints, taint)
	if err := m.updateNode(ctx, t, upd); err != nil {
		return fmt.Errorf("taint node %s out of service: %w", node.Name, err)
	}
	klog.FromContext(ctx).Info("guest node NotReady and its guest stopped: tainted out of service", "taint", taintString(taint), "why", why)
	m.event(ctx, node, corev1.EventTypeWarning, "NodeOutOfService",
		fmt.Sprintf("node is NotReady and the guest of its VM %s is stopped (%s): tainted %s, so Kubernetes deletes its pods and detaches their volumes, and the driver removes its volumes from the VM", vm, why, taintString(taint)))
	return nil
}

func (m *Monitor) untaint(ctx context.Context, t *term, node *corev1.Node, vm string) error {
	upd := node.DeepCopy()
	upd.Spec.Taints = slices.DeleteFunc(upd.Spec.Taints, func(t corev1.Taint) bool {
		return t.Key == OutOfServiceTaint.Key && t.Effect == corev1.TaintEffectNoExecute
	})
	if err := m.updateNode(ctx, t, upd); err != nil {
		return fmt.Errorf("remove the out-of-service taint of node %s: %w", node.Name, err)
	}
	klog.FromContext(ctx).Info("guest node Ready on a running VM: out-of-service taint removed")
	m.event(ctx, node, corev1.EventTypeNormal, "NodeBackInService",
		fmt.Sprintf("node is Ready and its VM %s runs: out-of-service taint removed", vm))
	return nil
}

// owned keeps the volumes that are this guest cluster's (a guest PV of this
// driver names them): a VM of this cluster should hold no other, and if it
// does, that volume is another cluster's to release. The shared PV cache is
// enough here, unlike for an orphan: the guest was just read stopped, so the
// release unplugs nothing in use, and a cache that lags can only hold back a
// volume whose PV it has not seen yet (released at the Node's next resync)
// or release one whose PV was deleted a moment ago, still this cluster's
// volume on this cluster's VM.
func (m *Monitor) owned(ctx context.Context, volumes []string) ([]string, error) {
	if len(volumes) == 0 {
		return nil, nil
	}
	owned, err := m.nodes.cachedOwned()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, v := range volumes {
		if owned.Has(v) {
			out = append(out, v)
		} else {
			klog.FromContext(ctx).Info("a volume of the VM is no guest PV's of this cluster: not released", "volume", v)
		}
	}
	return out, nil
}

// release removes a fenced node's volumes from its VM through the queue, all
// at once so that the queue merges them into as few VM changes as it can.
// The queue writes them only before the confirmed lease could have passed to
// another replica; a detach it drops for that is retried with a new check.
func (m *Monitor) release(ctx context.Context, t *term, node *corev1.Node, vm string, volumes []string, why string) error {
	if len(volumes) == 0 {
		return nil
	}
	until, err := m.confirm(ctx, t)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, m.cfg.DetachTimeout)
	defer cancel()
	logger := klog.FromContext(ctx)
	logger.Info("guest node out of service: removing its volumes from the VM", "volumes", volumes, "why", why)
	errs := make([]error, len(volumes))
	var wg sync.WaitGroup
	for i, vol := range volumes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := m.vms.DetachBefore(ctx, vm, vol, until); err != nil {
				errs[i] = fmt.Errorf("volume %s: %w", vol, err)
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("remove the volumes of out-of-service node %s from VM %s: %w", node.Name, vm, err)
	}
	logger.Info("volumes of the out-of-service node removed from its VM", "volumes", volumes)
	m.event(ctx, node, corev1.EventTypeNormal, "VolumesRemovedFromVM",
		fmt.Sprintf("node is out of service and the guest of its VM %s is stopped (%s): volumes %s removed from the VM", vm, why, strings.Join(volumes, ", ")))
	return nil
}

func (m *Monitor) event(ctx context.Context, node *corev1.Node, eventType, reason, message string) {
	if m.events != nil {
		m.events.NodeEvent(ctx, node, eventType, reason, message)
	}
}

func taintString(t corev1.Taint) string {
	return t.Key + "=" + t.Value + ":" + string(t.Effect)
}
