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
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// The lease upstream's node controller is elected under, so that during an
// upgrade from the upstream chart only one of them fences nodes.
const (
	DefaultLeaseNamespace = "kube-system"
	DefaultLeaseName      = "harvester-csi-node-monitor"
)

// VMs is what the monitor needs of the host side: the informers' view of a
// VM, and the hotplug queue, through which every volume leaves a VM.
type VMs interface {
	// Synced reports whether the host's VM and VMI caches are filled; until
	// then every VM would look stopped.
	Synced() bool
	View(vm string) hotplug.VMView
	Detach(ctx context.Context, vm, volume string) error
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
// a guest Node that is NotReady while its VM does not run is tainted out of
// service (Kubernetes then force-deletes its pods and detaches their
// volumes at once); the hotplug volumes of a Node so tainted are removed
// from its VM through the hotplug queue; a Ready Node on a running VM loses
// the taint. A Node whose VM the host does not show is left alone: it may be
// no VM of this cluster's host at all, and fencing it on a guess could force
// pods off a live machine.
type Monitor struct {
	cfg    MonitorConfig
	client kubernetes.Interface
	nodes  *Nodes
	vms    VMs
	events EventSink

	leading atomic.Bool
	// queue is the current term's work queue, nil while not leading.
	queue atomic.Pointer[workqueue.TypedRateLimitingInterface[string]]
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

// Leading reports whether this replica holds the lease now.
func (m *Monitor) Leading() bool { return m.leading.Load() }

// Identity is this replica's name in the Lease.
func (m *Monitor) Identity() string { return m.cfg.Identity }

// VMChanged looks again at the guest Nodes of a VM whose VM or VMI changed:
// a VM that stops after its Node went NotReady changes no Node.
func (m *Monitor) VMChanged(vm string) {
	q := m.queue.Load()
	if q == nil {
		return
	}
	for _, n := range m.nodes.NodesOfVM(vm) {
		(*q).Add(n.Name)
	}
}

func (m *Monitor) enqueueObj(obj any) {
	if q := m.queue.Load(); q != nil {
		if n, ok := obj.(*corev1.Node); ok {
			(*q).Add(n.Name)
		}
	}
}

// Run takes part in the election until ctx ends, working while it leads.
func (m *Monitor) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithValues("lease", m.cfg.LeaseNamespace+"/"+m.cfg.LeaseName, "identity", m.cfg.Identity)
	ctx = klog.NewContext(ctx, logger)
	for ctx.Err() == nil {
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
				OnStartedLeading: m.lead,
				OnStoppedLeading: func() {
					m.leading.Store(false)
					logger.Info("guest node monitor: no longer leading")
				},
			},
		})
		if err != nil {
			return err
		}
		le.Run(ctx)
	}
	return nil
}

// lead works the monitor for one term.
func (m *Monitor) lead(ctx context.Context) {
	logger := klog.FromContext(ctx)
	logger.Info("guest node monitor: leading")
	q := workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](time.Second, time.Minute),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: "guest-node-monitor"})
	defer q.ShutDown()
	// Decide nothing before both sides are cached: an empty VMI cache says
	// every VM is stopped.
	if !cache.WaitForCacheSync(ctx.Done(), m.nodes.HasSynced, m.vms.Synced) {
		return
	}
	m.queue.Store(&q)
	defer m.queue.Store(nil)
	m.leading.Store(true)
	for _, name := range m.nodes.nodes.GetStore().ListKeys() {
		q.Add(name)
	}
	var wg sync.WaitGroup
	for range m.cfg.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m.next(ctx, q) {
			}
		}()
	}
	<-ctx.Done()
	q.ShutDown()
	wg.Wait()
}

func (m *Monitor) next(ctx context.Context, q workqueue.TypedRateLimitingInterface[string]) bool {
	name, quit := q.Get()
	if quit {
		return false
	}
	defer q.Done(name)
	if err := m.sync(ctx, name); err != nil {
		klog.FromContext(ctx).Error(err, "guest node monitor: will retry", "node", name)
		q.AddRateLimited(name)
		return true
	}
	q.Forget(name)
	return true
}

// sync takes the one decision the Node and its VM call for.
func (m *Monitor) sync(ctx context.Context, name string) error {
	node, ok := m.nodes.Node(name)
	if !ok || node.DeletionTimestamp != nil {
		return nil
	}
	ready, known := nodeReady(node)
	vm := m.nodes.VMOfNode(name)
	logger := klog.FromContext(ctx).WithValues("node", name, "vm", vm)
	ctx = klog.NewContext(ctx, logger)
	if !known {
		return nil // kubelet has not reported yet
	}
	view := m.vms.View(vm)
	if !view.Exists {
		logger.V(3).Info("no VM of that name on the host: not monitored")
		return nil
	}
	tainted := OutOfService(node)
	switch {
	case ready && view.Running && tainted:
		return m.untaint(ctx, node, vm)
	case !ready && !view.Running && !tainted:
		return m.taint(ctx, node, vm)
	case !ready && !view.Running && tainted:
		return m.release(ctx, node, vm, view.Volumes)
	}
	return nil
}

func nodeReady(node *corev1.Node) (ready, known bool) {
	for _, c := range node.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue, true
		}
	}
	return false, false
}

func (m *Monitor) taint(ctx context.Context, node *corev1.Node, vm string) error {
	upd := node.DeepCopy()
	t := OutOfServiceTaint
	now := metav1.Now()
	t.TimeAdded = &now
	upd.Spec.Taints = append(upd.Spec.Taints, t)
	if _, err := m.client.CoreV1().Nodes().Update(ctx, upd, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("taint node %s out of service: %w", node.Name, err)
	}
	klog.FromContext(ctx).Info("guest node NotReady and its VM not running: tainted out of service", "taint", taintString(t))
	m.event(ctx, node, corev1.EventTypeWarning, "NodeOutOfService",
		fmt.Sprintf("node is NotReady and its VM %s is not running: tainted %s, so Kubernetes deletes its pods and detaches their volumes, and the driver removes its volumes from the VM", vm, taintString(t)))
	return nil
}

func (m *Monitor) untaint(ctx context.Context, node *corev1.Node, vm string) error {
	upd := node.DeepCopy()
	upd.Spec.Taints = slices.DeleteFunc(upd.Spec.Taints, func(t corev1.Taint) bool {
		return t.Key == OutOfServiceTaint.Key && t.Effect == corev1.TaintEffectNoExecute
	})
	if _, err := m.client.CoreV1().Nodes().Update(ctx, upd, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("remove the out-of-service taint of node %s: %w", node.Name, err)
	}
	klog.FromContext(ctx).Info("guest node Ready on a running VM: out-of-service taint removed")
	m.event(ctx, node, corev1.EventTypeNormal, "NodeBackInService",
		fmt.Sprintf("node is Ready and its VM %s runs: out-of-service taint removed", vm))
	return nil
}

// release removes a fenced node's volumes from its VM through the queue, all
// at once so that the queue merges them into as few VM changes as it can.
func (m *Monitor) release(ctx context.Context, node *corev1.Node, vm string, volumes []string) error {
	if len(volumes) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, m.cfg.DetachTimeout)
	defer cancel()
	logger := klog.FromContext(ctx)
	logger.Info("guest node out of service: removing its volumes from the VM", "volumes", volumes)
	errs := make([]error, len(volumes))
	var wg sync.WaitGroup
	for i, vol := range volumes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := m.vms.Detach(ctx, vm, vol); err != nil {
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
		fmt.Sprintf("node is out of service and its VM %s is not running: volumes %s removed from the VM", vm, strings.Join(volumes, ", ")))
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
