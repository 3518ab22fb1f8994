package kubevirtsim

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// Sim is a running KubeVirt simulator: one object per simulated controller,
// wired to one API server. Create it with New, run it with Start and end it
// with Stop (or by cancelling Start's context, then Stop). The methods in
// testapi.go create and watch VMs and claims; Faults injects faults.
type Sim struct {
	c *cluster

	vms       *vmController
	vmis      *vmiController
	handler   *virtHandler
	kubelet   *kubelet
	prov      *provisioner
	snaps     *snapshotter
	backups   *backupper
	netfs     *networkFSManager
	migs      *migrationController
	api       *virtAPI
	hooks     *webhooks
	proxy     *proxy
	faults    *Faults
	runnables []runnable

	lifeMu  sync.Mutex
	started bool
	stopped bool
	cancel  context.CancelFunc
}

// runnable is a simulated controller: it registers its event handlers on
// the shared informers and runs its workers.
type runnable interface {
	register()
	run(ctx context.Context)
	shutdown()
}

// New prepares a simulator for the API server that cfg reaches as an admin.
// It does not touch the cluster; Start does.
func New(cfg *rest.Config, opts Options) (*Sim, error) {
	c, err := newCluster(cfg, opts)
	if err != nil {
		return nil, err
	}
	s := &Sim{c: c}
	s.faults = newFaults(c)
	s.kubelet = newKubelet(c, s.faults)
	s.prov = newProvisioner(c)
	s.snaps = newSnapshotter(c)
	s.backups = newBackupper(c)
	s.netfs = newNetworkFSManager(c)
	s.handler = newVirtHandler(c, s.faults)
	s.vmis = newVMIController(c, s.faults)
	s.api = newVirtAPI(c)
	s.vms = newVMController(c, s.api)
	s.hooks = newWebhooks(c, s.faults)
	s.prov.snapshots = s.snaps
	s.snaps.prov = s.prov
	s.migs = newMigrationController(c)
	s.faults.wire(s.vms, s.vmis, s.handler, s.kubelet)
	s.faults.holdMigration = s.migs.hold
	s.runnables = []runnable{s.vms, s.vmis, s.handler, s.kubelet, s.prov, s.snaps, s.backups, s.netfs, s.migs}
	if c.opts.Kubelets {
		// Real kubelets run the pods: the simulator's stands aside.
		s.runnables = slices.DeleteFunc(s.runnables, func(r runnable) bool { return r == runnable(s.kubelet) })
	}
	return s, nil
}

// Start installs the CRDs and configuration, starts the
// informers, the admission webhooks, the front proxy and the controllers, and
// returns once everything is serving. The simulator runs until ctx is
// cancelled or Stop is called. The logger in ctx (klog.FromContext) is used.
func (s *Sim) Start(ctx context.Context) error {
	s.lifeMu.Lock()
	defer s.lifeMu.Unlock()
	if s.started {
		return errors.New("kubevirtsim: already started")
	}
	s.started = true
	s.c.log = klog.FromContext(ctx).WithName("kubevirtsim")
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s.cancel = cancel
	stopWith := func(err error) error {
		cancel()
		s.shutdown()
		return err
	}
	go func() {
		select {
		case <-ctx.Done():
			cancel()
		case <-runCtx.Done():
		}
	}()

	if err := s.c.install(ctx); err != nil {
		return stopWith(err)
	}
	s.c.setupInformers()
	for _, r := range s.runnables {
		r.register()
	}
	for _, inf := range s.c.informers() {
		s.c.goRun(func() { inf.RunWithContext(runCtx) })
	}
	if !cache.WaitForCacheSync(ctx.Done(), s.c.hasSynced()...) {
		return stopWith(fmt.Errorf("kubevirtsim: caches did not sync: %w", context.Cause(ctx)))
	}
	if err := s.hooks.start(ctx); err != nil {
		return stopWith(err)
	}
	s.api.life = runCtx
	p, err := startProxy(s.c, s.api)
	if err != nil {
		return stopWith(err)
	}
	s.proxy = p
	for _, r := range s.runnables {
		r.run(runCtx)
	}
	s.c.log.V(1).Info("simulator started", "version", s.c.opts.Version, "mode", s.c.opts.Mode, "namespace", s.c.opts.Namespace, "proxy", p.url)
	return nil
}

// Stop ends the simulator: it stops the controllers and servers, removes its
// webhook configuration (so the API server does not call a dead webhook) and
// waits for its goroutines. Safe to call more than once.
func (s *Sim) Stop() {
	s.lifeMu.Lock()
	defer s.lifeMu.Unlock()
	if !s.started || s.stopped {
		return
	}
	s.stopped = true
	s.cancel()
	s.shutdown()
}

func (s *Sim) shutdown() {
	for _, r := range s.runnables {
		r.shutdown()
	}
	if s.proxy != nil {
		s.proxy.close()
	}
	s.hooks.stop()
	s.c.wg.Wait()
}

// Faults returns the fault switches of this simulator.
func (s *Sim) Faults() *Faults { return s.faults }

// ClientConfig reaches the simulated host cluster through the front proxy
// (plain HTTP on 127.0.0.1) with the admin token. Use it for everything a
// driver does, so the subresources exist and Stats counts the requests.
// Valid after Start.
func (s *Sim) ClientConfig() *rest.Config {
	return &rest.Config{
		Host:        s.proxy.url,
		BearerToken: s.c.cfg.BearerToken,
		QPS:         s.c.cfg.QPS,
		Burst:       s.c.cfg.Burst,
	}
}

// ProxyURL is the front proxy's base URL.
func (s *Sim) ProxyURL() string { return s.proxy.url }

// Stats returns a snapshot of the proxy's counters (empty before Start).
func (s *Sim) Stats() Stats { return s.proxy.stats() }

// ResetStats zeroes the proxy's counters.
func (s *Sim) ResetStats() { s.proxy.reset() }
