package driver

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sync/errgroup"

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

	mu      sync.Mutex
	waiting string // why the controller is not ready yet
}

// NewController builds the controller side. It does no I/O: Run does.
func NewController(cfg ControllerConfig) *Controller {
	c := &Controller{cfg: cfg, waiting: "starting"}
	c.service = NewControllerService(cfg.Options, c, cfg.Host)
	return c
}

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
	backend, err := host.NewBackend(ctx, c.cfg.Host, c.cfg.Backend, c.setWaiting)
	if err != nil {
		return err
	}
	vmInf, vmiInf := c.cfg.Host.VMInformer(0), c.cfg.Host.VMIInformer(0)
	qcfg := c.cfg.Queue
	qcfg.Namespace = c.cfg.Host.Namespace
	q, err := hotplug.New(qcfg, backend, c.cfg.Host, vmInf, vmiInf, c.cfg.Metrics)
	if err != nil {
		return err
	}
	c.setWaiting("waiting for the host's VM and VMI caches to sync")
	c.queue.Store(q)
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { vmInf.RunWithContext(ctx); return nil })
	g.Go(func() error { vmiInf.RunWithContext(ctx); return nil })
	g.Go(func() error { return q.Run(ctx) })
	return g.Wait()
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
