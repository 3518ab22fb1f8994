package driver

import (
	"context"
	"errors"
	"github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sync/errgroup"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// ControllerConfig is what the controller side of the driver is built from.
type ControllerConfig struct {
	// Host reaches the host namespace of the guest cluster's VMs.
	Host *host.Client
	// Backend is --hotplug-backend: auto, declarative or subresource.
	Backend string
	// Queue tunes the hotplug queue; its Namespace is taken from Host.
	Queue hotplug.Config
	// Options configure the CSI controller service.
	Options ControllerOptions
	// Metrics, when set, receives the queue's metrics.
	Metrics hotplug.Registerer
	// Guest reaches the guest cluster this driver serves; nil turns the
	// detach guard and the guest node monitor off.
	Guest kubernetes.Interface
	// DetachGuardTimeout is --detach-guard-timeout: how long an unplug
	// waits for the guest to stop using the volume (0: the guard is off).
	DetachGuardTimeout time.Duration
	// NodeMonitor runs the guest node monitor (elected) when Guest is set.
	NodeMonitor bool
	// Monitor tunes the guest node monitor.
	Monitor guest.MonitorConfig
}

// Controller is the controller side of the driver: the hotplug backend, the
// host's VM and VMI informers, the per-VM hotplug queue and the CSI
// controller service over them. It is built at once and made ready by Run;
// until then its service answers Unavailable and Probe says not ready, so no
// caller is ever answered from caches that have not synced.
type Controller struct {
	cfg     ControllerConfig
	service csi.ControllerServer
	queue   atomic.Pointer[hotplug.Queue]
	// guestNodes, guard and monitor exist only with a guest client.
	guestNodes *guest.Nodes
	// attachmentEvents says on guest VolumeAttachments what a publish or
	// unpublish waits for.
	attachmentEvents *guest.AttachmentEvents
	// events records every guest Event of the controller.
	events  *guest.Recorder
	guard   *guest.Guard
	monitor *guest.Monitor
	// claims watches guest pods for RWX unpublishes (with a guest client).
	claims *guest.Claims
	// claimCache holds the host's PVCs for the publish's first check.
	claimCache *host.ClaimCache
	// rwx is set by Run when the host lists NetworkFilesystems.
	rwx atomic.Bool
	// buildErr is a failure of NewController, returned by Run.
	buildErr error

	mu      sync.Mutex
	waiting string // why the controller is not ready yet
}

// NewController builds the controller side. It does no I/O: Run does.
func NewController(cfg ControllerConfig) *Controller {
	c := &Controller{cfg: cfg, waiting: "starting"}
	if cfg.Guest != nil {
		c.buildErr = c.buildGuest()
	}
	opts := cfg.Options
	if c.guard != nil {
		opts.DetachGuard = c.guard
	}
	if c.attachmentEvents != nil {
		opts.Events = c.attachmentEvents
	}
	if cfg.Host != nil {
		opts.NetworkFS = cfg.Host
		opts.RWX = c.rwx.Load
		c.claimCache = cfg.Host.ClaimCache(0)
		opts.Claims = c.claimCache
	}
	if c.claims != nil {
		opts.ClaimUsers = c.claims
		opts.Attachments = c.claims
	}
	if cfg.Host != nil {
		opts.VMs = c
	}
	c.service = NewControllerService(opts, c, cfg.Host)
	return c
}

// guestResync re-delivers every guest Node to the monitor now and then, so a
// decision that also depends on the host side is taken again even when
// nothing in the guest changes.
const guestResync = time.Minute

func (c *Controller) buildGuest() error {
	nodes, err := guest.NewNodes(c.cfg.Guest, Name, guestResync)
	if err != nil {
		return err
	}
	c.guestNodes = nodes
	if c.claims, err = guest.NewClaims(c.cfg.Guest, Name, nodes); err != nil {
		return err
	}
	c.events = guest.NewRecorder(c.cfg.Guest, Name, "")
	c.attachmentEvents = guest.NewAttachmentEvents(c.cfg.Guest, nodes, Name, c.events)
	if c.cfg.DetachGuardTimeout > 0 {
		c.guard = guest.NewGuard(nodes, c.events, c.cfg.DetachGuardTimeout)
	}
	if c.cfg.NodeMonitor {
		if c.monitor, err = guest.NewMonitor(c.cfg.Monitor, c.cfg.Guest, nodes, monitorVMs{c}, c.events); err != nil {
			return err
		}
	}
	return nil
}

// Monitor is the guest node monitor, nil when it does not run.
func (c *Controller) Monitor() *guest.Monitor { return c.monitor }

// GuestNodes is the cache of guest Nodes and CSINodes, nil without a guest
// client.
func (c *Controller) GuestNodes() *guest.Nodes { return c.guestNodes }

// Service is the CSI controller service.
func (c *Controller) Service() csi.ControllerServer { return c.service }

// Queue is the hotplug queue once Run has built it, nil before.
func (c *Controller) Queue() *hotplug.Queue { return c.queue.Load() }

// Ready returns nil once the informers have synced and the queue works, and
// otherwise says what the controller is waiting for.
func (c *Controller) Ready() error {
	if q := c.queue.Load(); q != nil && q.Ready() {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return errors.New("controller not ready: " + c.waiting)
}

func (c *Controller) setWaiting(why string) {
	c.mu.Lock()
	c.waiting = why
	c.mu.Unlock()
}

// Run detects the hotplug backend (asking again while the host does not
// answer), builds the queue, runs the informers and works the queue until
// ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	if c.buildErr != nil {
		return c.buildErr
	}
	logger := klog.FromContext(ctx)
	switch {
	case c.guestNodes == nil:
		logger.Error(nil, "NO GUEST CLUSTER CLIENT: the detach guard and the guest node monitor are OFF; a volume may be unplugged while its guest still has it mounted, and Nodes of stopped VMs are not fenced")
	case c.guard == nil:
		logger.Info("detach guard off (--detach-guard-timeout=0): volumes are unplugged without asking the guest")
	}
	backend, err := kubevirt.NewBackend(ctx, c.cfg.Host, c.cfg.Backend, c.setWaiting)
	if err != nil {
		return err
	}
	c.detectRWX(ctx)
	vmInf, vmiInf := c.cfg.Host.VMInformer(0), c.cfg.Host.VMIInformer(0)
	if d, ok := backend.(*kubevirt.Declarative); ok {
		d.Follow(vmInf.GetStore())
	}
	qcfg := c.cfg.Queue
	qcfg.Namespace = c.cfg.Host.Namespace
	q, err := hotplug.New(qcfg, backend, kubevirt.NewClaimReader(c.cfg.Host), vmInf, vmiInf, c.cfg.Metrics)
	if err != nil {
		return err
	}
	c.setWaiting("waiting for the host's VM and VMI caches to sync")
	c.queue.Store(q)
	if c.monitor != nil {
		h := cache.ResourceEventHandlerFuncs{
			AddFunc:    c.vmChanged,
			UpdateFunc: func(_, obj any) { c.vmChanged(obj) },
			DeleteFunc: c.vmChanged,
		}
		for _, inf := range []cache.SharedIndexInformer{vmInf, vmiInf} {
			if _, err := inf.AddEventHandler(h); err != nil {
				return err
			}
		}
	}
	if c.events != nil {
		defer c.events.Stop()
	}
	g, ctx := errgroup.WithContext(ctx)
	if c.guestNodes != nil {
		c.guestNodes.SetVMUIDs(vmUIDs(vmInf.GetStore(), c.cfg.Host.Namespace))
	}
	g.Go(func() error { vmInf.RunWithContext(ctx); return nil })
	g.Go(func() error { vmiInf.RunWithContext(ctx); return nil })
	g.Go(func() error { c.claimCache.Run(ctx); return nil })
	g.Go(func() error { return q.Run(ctx) })
	if c.guestNodes != nil {
		c.guestNodes.Start(ctx.Done())
	}
	if c.claims != nil && c.rwx.Load() {
		c.claims.Start(ctx.Done())
	}
	if c.monitor != nil {
		g.Go(func() error { return c.monitor.Run(ctx) })
	}
	return g.Wait()
}

func (c *Controller) vmChanged(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	if o, ok := obj.(interface{ GetName() string }); ok {
		c.monitor.VMChanged(o.GetName())
	}
}

// vmUIDs reads a VM's UID from the host cache: Harvester's cloud provider
// names it in the providerID of the VM's guest Node, so the guest Node of a
// VM is found even while its CSINode lacks the driver.
func vmUIDs(store cache.Store, namespace string) guest.VMUIDs {
	return func(vm string) (types.UID, bool) {
		obj, ok, _ := store.GetByKey(namespace + "/" + vm)
		if !ok {
			return "", false
		}
		m, ok := obj.(metav1.Object)
		if !ok {
			return "", false
		}
		return m.GetUID(), true
	}
}

// monitorVMs gives the guest node monitor the queue's view of the host.
type monitorVMs struct{ c *Controller }

func (m monitorVMs) Synced() bool {
	q := m.c.queue.Load()
	return q != nil && q.Ready()
}

func (m monitorVMs) View(vm string) hotplug.VMView {
	if q := m.c.queue.Load(); q != nil && q.Ready() {
		return q.View(vm)
	}
	return hotplug.VMView{}
}

func (m monitorVMs) GuestStopped(ctx context.Context, vm string) (bool, string, error) {
	ctx, cancel := context.WithTimeout(ctx, hostCallTimeout)
	defer cancel()
	return m.c.cfg.Host.GuestStopped(ctx, vm)
}

func (m monitorVMs) DetachBefore(ctx context.Context, vm, volume string, deadline time.Time) error {
	q := m.c.queue.Load()
	if q == nil {
		return hotplug.ErrNotReady
	}
	return q.DetachBefore(ctx, vm, volume, deadline)
}

// The controller service reaches the queue through these, so that it can be
// built before the queue exists.

func (c *Controller) Attach(ctx context.Context, vm, volume string, exclusive bool) error {
	q := c.queue.Load()
	if q == nil {
		return hotplug.ErrNotReady
	}
	return q.Attach(ctx, vm, volume, exclusive)
}

func (c *Controller) Detach(ctx context.Context, vm, volume string) error {
	q := c.queue.Load()
	if q == nil {
		return hotplug.ErrNotReady
	}
	return q.Detach(ctx, vm, volume)
}

func (c *Controller) Holders(volume string) []string {
	if q := c.queue.Load(); q != nil {
		return q.Holders(volume)
	}
	return nil
}

func (c *Controller) Published() map[string][]string {
	if q := c.queue.Load(); q != nil {
		return q.Published()
	}
	return nil
}

func (c *Controller) Lost(volume string) []string {
	if q := c.queue.Load(); q != nil {
		return q.Lost(volume)
	}
	return nil
}

// VMExists says whether the host has the VM: the queue's VM cache when it
// shows it, else a read of the API server (a VM created a moment ago may not
// be in the cache yet).
func (c *Controller) VMExists(ctx context.Context, vm string) (bool, error) {
	if q := c.queue.Load(); q != nil && q.Ready() && q.View(vm).Exists {
		return true, nil
	}
	return kubevirt.NewReader(c.cfg.Host).VMExists(ctx, vm)
}

// ClaimUsers names the guest pods the controller's cache sees using the
// claim of a volume (what an RWX unpublish consults first).
func (c *Controller) ClaimUsers(ctx context.Context, volume string) ([]string, error) {
	if c.claims == nil {
		return nil, errors.New("no guest client")
	}
	return c.claims.Users(ctx, volume, false)
}

// RWXEnabled reports whether ReadWriteMany volumes are served: the host
// listed NetworkFilesystems when Run started.
func (c *Controller) RWXEnabled() bool { return c.rwx.Load() }

// rwxProbes bounds how often start-up asks again when listing
// NetworkFilesystems fails for a reason other than "not there" or "not
// allowed" (the host answered the backend detection just before).
const rwxProbes = 3

// detectRWX lists NetworkFilesystems once, as upstream does at start-up:
// MULTI_NODE_MULTI_WRITER is offered only when that works.
func (c *Controller) detectRWX(ctx context.Context) {
	logger := klog.FromContext(ctx)
	var err error
	for i := range rwxProbes {
		probeCtx, cancel := context.WithTimeout(ctx, hostCallTimeout)
		err = c.cfg.Host.NetworkFSAvailable(probeCtx)
		cancel()
		if err == nil || apierrors.IsNotFound(err) || apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err) || ctx.Err() != nil {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(i+1) * time.Second):
		}
	}
	if err != nil {
		logger.Info("ReadWriteMany volumes are OFF: the host does not list NetworkFilesystems (Harvester networkfs-manager missing, or no permission)",
			"namespace", host.NetworkFSNamespace, "err", err.Error())
		return
	}
	c.rwx.Store(true)
	if c.claims == nil {
		logger.Info("ReadWriteMany volumes are ON, but without a guest client an unpublish never disables an export (it cannot tell whether pods still use it)")
		return
	}
	logger.Info("ReadWriteMany volumes are ON (Harvester NetworkFilesystems)", "namespace", host.NetworkFSNamespace)
}
