package driver

import (
	"context"
	"errors"
	"fmt"
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
	"github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
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
	// Orphans runs the orphan reconciler (elected with the node monitor,
	// on its Lease) when Guest is set.
	Orphans bool
	// Orphan tunes the orphan reconciler.
	Orphan guest.OrphanConfig
}

// Controller is the controller side of the driver: the hotplug backend, the
// host's VM and VMI informers, the per-VM hotplug queue and the CSI
// controller service over them, all built by NewController and made ready by
// Run; until then its service answers Unavailable and Probe says not ready,
// so no caller is ever answered from caches that have not synced.
type Controller struct {
	cfg     ControllerConfig
	service csi.ControllerServer
	// queue is nil only when buildErr is set.
	queue         *hotplug.Queue
	vmInf, vmiInf cache.SharedIndexInformer
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

	mu sync.Mutex
	// waiting is why Run has not finished starting (empty once it has);
	// the queue says why it is not ready itself.
	waiting string
}

// NewController builds the controller side. It does no I/O: Run does.
func NewController(cfg ControllerConfig) *Controller {
	c := &Controller{cfg: cfg, waiting: "starting"}
	if cfg.Host == nil {
		c.buildErr = errors.New("the controller needs a host cluster client")
	} else {
		c.buildErr = c.buildQueue()
	}
	if c.buildErr == nil && cfg.Guest != nil {
		c.buildErr = c.buildGuest()
	}
	opts := cfg.Options
	if c.guard != nil {
		opts.DetachGuard = c.guard
	}
	if c.attachmentEvents != nil {
		opts.Events = c.attachmentEvents
		c.queue.SetWedgeReporter(NewWedgeEvents(c.attachmentEvents))
	}
	if cfg.Host != nil {
		opts.NetworkFS = cfg.Host
		opts.RWX = c.rwx.Load
		c.claimCache = cfg.Host.ClaimCache(0)
		opts.Claims = c.claimCache
		if c.queue != nil {
			c.queue.SetClaimCache(c.claimCache)
		}
		opts.HostStorage = host.NewStorageReader(cfg.Host)
		opts.VMs = c
	}
	if c.claims != nil {
		opts.ClaimUsers = c.claims
		opts.Attachments = c.claims
	}
	c.service = NewControllerService(opts, c.queue, cfg.Host)
	return c
}

// buildQueue builds the host's VM and VMI informers, the hotplug backend
// (which learns the host's hotplug path when the queue runs, for "auto")
// and the queue over them.
func (c *Controller) buildQueue() error {
	c.vmInf, c.vmiInf = c.cfg.Host.VMInformer(0), c.cfg.Host.VMIInformer(0)
	backend, err := kubevirt.NewBackend(c.cfg.Host, c.cfg.Backend, c.vmInf.GetStore())
	if err != nil {
		return err
	}
	qcfg := c.cfg.Queue
	qcfg.Namespace = c.cfg.Host.Namespace
	c.queue, err = hotplug.New(qcfg, backend, kubevirt.NewClaimReader(c.cfg.Host), c.vmInf, c.vmiInf, c.cfg.Metrics)
	return err
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
	if !c.cfg.NodeMonitor && !c.cfg.Orphans {
		return nil
	}
	mcfg := c.cfg.Monitor
	mcfg.FencingOff = !c.cfg.NodeMonitor
	vms := monitorVMs{c.queue, c.cfg.Host}
	if c.monitor, err = guest.NewMonitor(mcfg, c.cfg.Guest, nodes, vms, c.events); err != nil {
		return err
	}
	if c.cfg.Orphans {
		orphans, err := guest.NewOrphans(c.cfg.Orphan, c.cfg.Guest, nodes, vms, c.events, c.cfg.Metrics)
		if err != nil {
			return err
		}
		c.monitor.SetOrphans(orphans)
	}
	h := cache.ResourceEventHandlerFuncs{
		AddFunc:    c.vmChanged,
		UpdateFunc: func(_, obj any) { c.vmChanged(obj) },
		DeleteFunc: c.vmChanged,
	}
	for _, inf := range []cache.SharedIndexInformer{c.vmInf, c.vmiInf} {
		if _, err := inf.AddEventHandler(h); err != nil {
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

// Queue is the hotplug queue (nil only when NewController failed).
func (c *Controller) Queue() *hotplug.Queue { return c.queue }

// Ready returns nil once Run has started everything, the backend knows the
// host's hotplug path and the informers have synced, and otherwise says what
// the controller is waiting for.
func (c *Controller) Ready() error {
	if c.buildErr != nil {
		return fmt.Errorf("controller not ready: %w", c.buildErr)
	}
	why := c.queue.Waiting()
	if why == "" {
		c.mu.Lock()
		why = c.waiting
		c.mu.Unlock()
	}
	if why == "" {
		return nil
	}
	return errors.New("controller not ready: " + why)
}

func (c *Controller) setWaiting(why string) {
	c.mu.Lock()
	c.waiting = why
	c.mu.Unlock()
}

// Run runs the informers and the queue (whose backend first learns the
// host's hotplug path, asking again while the host does not answer), then,
// once the host has answered, looks for NetworkFilesystems, and works until
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
	if c.guestNodes != nil && !c.cfg.Orphans {
		logger.Info("orphan reconciler off (--orphan-reconciler=false): volumes hot-plugged without a VolumeAttachment stay on their VMs")
	}
	if c.events != nil {
		defer c.events.Stop()
	}
	g, ctx := errgroup.WithContext(ctx)
	if c.guestNodes != nil {
		c.guestNodes.SetVMUIDs(vmUIDs(c.vmInf.GetStore(), c.cfg.Host.Namespace))
	}
	g.Go(func() error { c.vmInf.RunWithContext(ctx); return nil })
	g.Go(func() error { c.vmiInf.RunWithContext(ctx); return nil })
	g.Go(func() error { c.claimCache.Run(ctx); return nil })
	g.Go(func() error { return c.queue.Run(ctx) })
	if c.guestNodes != nil {
		c.guestNodes.Start(ctx.Done())
	}
	if c.monitor != nil {
		g.Go(func() error { return c.monitor.Run(ctx) })
	}
	g.Go(func() error { c.startRWX(ctx); return nil })
	return g.Wait()
}

// startRWX decides whether ReadWriteMany volumes are served once the queue
// is ready: the host has answered by then, so a host that was down when the
// controller started does not turn them off for good.
func (c *Controller) startRWX(ctx context.Context) {
	c.setWaiting("looking for Harvester NetworkFilesystems")
	if !cache.WaitForCacheSync(ctx.Done(), c.queue.Ready) {
		return
	}
	c.detectRWX(ctx)
	if c.claims != nil && c.rwx.Load() {
		c.claims.Start(ctx.Done())
	}
	c.setWaiting("")
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

// monitorVMs is what the guest node monitor needs of the host: the queue,
// and a bounded read of whether a VM's guest is stopped.
type monitorVMs struct {
	*hotplug.Queue
	host *host.Client
}

func (m monitorVMs) GuestStopped(ctx context.Context, vm string) (bool, string, error) {
	ctx, cancel := context.WithTimeout(ctx, hostCallTimeout)
	defer cancel()
	return m.host.GuestStopped(ctx, vm)
}

// VMExists says whether the host has the VM: the queue's VM cache when it
// shows it, else a read of the API server (a VM created a moment ago may not
// be in the cache yet).
func (c *Controller) VMExists(ctx context.Context, vm string) (bool, error) {
	if c.queue.Ready() && c.queue.View(vm).Exists {
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
// listed NetworkFilesystems when it first answered after Run started.
func (c *Controller) RWXEnabled() bool { return c.rwx.Load() }

// rwxProbes bounds how often start-up asks again when listing
// NetworkFilesystems fails for a reason other than "not there" or "not
// allowed" (the host answered just before: the queue is ready).
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
