package kubevirtsim

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiextclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Sim is a running KubeVirt simulator. Create it with New, run it with Start
// and end it with Stop (or by cancelling Start's context, then Stop).
type Sim struct {
	opts Options
	t    Timings // scaled
	cfg  *rest.Config
	kube kubernetes.Interface
	kv   *kvClient
	ext  apiextclient.Interface
	dyn  dynamic.Interface
	jit  *jitterer
	log  klog.Logger

	vmInf, vmiInf, kvInf cache.SharedIndexInformer
	podInf, pvcInf       cache.SharedIndexInformer
	snapInf              cache.SharedIndexInformer // VolumeSnapshots (unstructured)
	podLister            corelisters.PodLister
	pvcLister            corelisters.PersistentVolumeClaimLister

	vmQueue   workqueue.TypedRateLimitingInterface[string]
	vmiQueue  workqueue.TypedRateLimitingInterface[string]
	podQueue  workqueue.TypedRateLimitingInterface[string]
	pvcQueue  workqueue.TypedRateLimitingInterface[string]
	snapQueue workqueue.TypedRateLimitingInterface[string]

	proxy   *proxy
	webhook *webhookServer
	changed notifier

	mu      sync.Mutex
	faults  faults
	vmis    map[types.UID]*vmiMem
	pods    map[types.UID]*podMem
	pvcSeen map[types.UID]time.Time
	// snapStart is when each VolumeSnapshot could first be taken;
	// restoreWait why each restoring claim is still Pending; restored the
	// claims restored already.
	snapStart   map[types.UID]time.Time
	restoreWait map[types.UID]string
	restored    map[types.UID]bool

	lifeMu  sync.Mutex
	started bool
	stopped bool
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

// New prepares a simulator for the API server that cfg reaches as an admin.
// It does not touch the cluster; Start does.
func New(cfg *rest.Config, opts Options) (*Sim, error) {
	if err := opts.setDefaults(); err != nil {
		return nil, err
	}
	c := rest.CopyConfig(cfg)
	if c.QPS == 0 {
		c.QPS, c.Burst = 200, 400
	}
	kube, err := kubernetes.NewForConfig(c)
	if err != nil {
		return nil, err
	}
	kv, err := newKVClient(c)
	if err != nil {
		return nil, err
	}
	ext, err := apiextclient.NewForConfig(c)
	if err != nil {
		return nil, err
	}
	dyn, err := dynamic.NewForConfig(c)
	if err != nil {
		return nil, err
	}
	s := &Sim{
		opts:    opts,
		t:       opts.Timings,
		cfg:     c,
		kube:    kube,
		kv:      kv,
		ext:     ext,
		dyn:     dyn,
		jit:     newJitterer(opts.Seed, opts.Jitter),
		log:     klog.Background().WithName("kubevirtsim"),
		vmis:    map[types.UID]*vmiMem{},
		pods:    map[types.UID]*podMem{},
		pvcSeen: map[types.UID]time.Time{},

		snapStart:   map[types.UID]time.Time{},
		restoreWait: map[types.UID]string{},
		restored:    map[types.UID]bool{},
	}
	s.faults.init()
	s.changed.init()
	return s, nil
}

// Options returns the effective options (defaults filled in, timings scaled).
func (s *Sim) Options() Options { return s.opts }

// Start installs the CRDs and configuration (see Install), starts the
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
	s.log = klog.FromContext(ctx).WithName("kubevirtsim")
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

	if err := s.Install(ctx); err != nil {
		return stopWith(err)
	}
	s.setupInformers()
	s.setupQueues()
	for _, inf := range []cache.SharedIndexInformer{s.vmInf, s.vmiInf, s.kvInf, s.podInf, s.pvcInf, s.snapInf} {
		s.goRun(func() { inf.RunWithContext(runCtx) })
	}
	if !cache.WaitForCacheSync(ctx.Done(), s.vmInf.HasSynced, s.vmiInf.HasSynced, s.kvInf.HasSynced, s.podInf.HasSynced, s.pvcInf.HasSynced, s.snapInf.HasSynced) {
		return stopWith(fmt.Errorf("kubevirtsim: caches did not sync: %w", context.Cause(ctx)))
	}

	wh, err := startWebhook(s)
	if err != nil {
		return stopWith(err)
	}
	s.webhook = wh
	if err := s.registerWebhooks(ctx); err != nil {
		return stopWith(err)
	}

	p, err := startProxy(s)
	if err != nil {
		return stopWith(err)
	}
	s.proxy = p

	s.runWorkers(runCtx, s.vmQueue, 3, s.syncVM)
	s.runWorkers(runCtx, s.vmiQueue, 3, s.syncVMI)
	s.runWorkers(runCtx, s.podQueue, 2, s.syncPod)
	s.runWorkers(runCtx, s.pvcQueue, 2, s.syncPVC)
	s.runWorkers(runCtx, s.snapQueue, 2, s.syncSnapshot)
	s.log.V(1).Info("simulator started", "mode", s.opts.Mode, "profile", s.opts.Profile, "namespace", s.opts.Namespace, "proxy", p.url)
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
	for _, q := range []workqueue.TypedRateLimitingInterface[string]{s.vmQueue, s.vmiQueue, s.podQueue, s.pvcQueue, s.snapQueue} {
		if q != nil {
			q.ShutDown()
		}
	}
	if s.proxy != nil {
		s.proxy.close()
	}
	if s.webhook != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		s.unregisterWebhooks(ctx)
		cancel()
		s.webhook.close()
	}
	s.wg.Wait()
}

func (s *Sim) goRun(f func()) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		f()
	}()
}

// ClientConfig reaches the simulated host cluster through the front proxy
// (plain HTTP on 127.0.0.1) with the admin token. Use it for everything a
// driver does, so the subresources exist and Stats counts the requests.
// Valid after Start.
func (s *Sim) ClientConfig() *rest.Config {
	return &rest.Config{
		Host:        s.proxy.url,
		BearerToken: s.cfg.BearerToken,
		QPS:         s.cfg.QPS,
		Burst:       s.cfg.Burst,
	}
}

// ProxyURL is the front proxy's base URL.
func (s *Sim) ProxyURL() string { return s.proxy.url }

// gates reports which hotplug machinery the KubeVirt CR enables right now.
func (s *Sim) gates() (legacy, declarative bool) {
	obj, ok, _ := s.kvInf.GetStore().GetByKey(s.opts.KubeVirtNamespace + "/" + s.opts.KubeVirtName)
	if !ok {
		return false, false
	}
	kv := obj.(*kubevirtv1.KubeVirt)
	var fg []string
	if dc := kv.Spec.Configuration.DeveloperConfiguration; dc != nil {
		fg = dc.FeatureGates
	}
	legacy = slices.Contains(fg, GateHotplugVolumes)
	declarative = !legacy && s.opts.Profile != ProfileV15 && slices.Contains(fg, GateDeclarativeHotplugVolumes)
	return legacy, declarative
}

func (s *Sim) setupInformers() {
	ns := s.opts.Namespace
	s.vmInf = s.kv.informer(resVMs, ns, &kubevirtv1.VirtualMachine{}, &kubevirtv1.VirtualMachineList{})
	s.vmiInf = s.kv.informer(resVMIs, ns, &kubevirtv1.VirtualMachineInstance{}, &kubevirtv1.VirtualMachineInstanceList{})
	s.kvInf = s.kv.informer(resKubeVirts, s.opts.KubeVirtNamespace, &kubevirtv1.KubeVirt{}, &kubevirtv1.KubeVirtList{})

	podFactory := informers.NewSharedInformerFactoryWithOptions(s.kube, 0, informers.WithNamespace(ns),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = labelAttachmentPod + "=" + valueAttachmentPod }))
	s.podInf = podFactory.Core().V1().Pods().Informer()
	s.podLister = podFactory.Core().V1().Pods().Lister()
	factory := informers.NewSharedInformerFactoryWithOptions(s.kube, 0, informers.WithNamespace(ns))
	s.pvcInf = factory.Core().V1().PersistentVolumeClaims().Informer()
	s.pvcLister = factory.Core().V1().PersistentVolumeClaims().Lister()
	s.setupSnapshotInformer()
}

func (s *Sim) setupQueues() {
	newQ := func(name string, base, max time.Duration) workqueue.TypedRateLimitingInterface[string] {
		return workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](base, max),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "kubevirtsim-" + name})
	}
	s.vmQueue = newQ("vm", s.t.BackoffBase, s.t.BackoffMax)
	s.vmiQueue = newQ("vmi", s.t.BackoffBase, max(s.t.HandlerPoll, s.t.BackoffBase))
	s.podQueue = newQ("pod", s.t.BackoffBase, max(s.t.HandlerPoll, s.t.BackoffBase))
	s.pvcQueue = newQ("pvc", s.t.BackoffBase, max(s.t.HandlerPoll, s.t.BackoffBase))
	s.snapQueue = newQ("snapshot", s.t.BackoffBase, max(s.t.HandlerPoll, s.t.BackoffBase))

	key := func(obj any) string {
		k, _ := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
		return k
	}
	handler := func(f func(obj any)) cache.ResourceEventHandlerFuncs {
		return cache.ResourceEventHandlerFuncs{
			AddFunc:    f,
			UpdateFunc: func(_, n any) { f(n) },
			DeleteFunc: f,
		}
	}
	_, _ = s.vmInf.AddEventHandler(handler(func(obj any) {
		s.vmQueue.AddAfter(key(obj), s.jit.d(s.t.VMReconcile))
		s.changed.notify()
	}))
	_, _ = s.vmiInf.AddEventHandler(handler(func(obj any) {
		k := key(obj)
		s.vmiQueue.AddAfter(k, s.jit.d(s.t.VMIReconcile))
		s.vmQueue.AddAfter(k, s.jit.d(s.t.VMReconcile)) // VMI name == VM name
		s.changed.notify()
	}))
	_, _ = s.kvInf.AddEventHandler(handler(func(any) { s.changed.notify() }))
	_, _ = s.podInf.AddEventHandler(handler(func(obj any) {
		s.podQueue.Add(key(obj))
		if vmi := podVMIKey(obj); vmi != "" {
			s.vmiQueue.AddAfter(vmi, s.jit.d(s.t.VMIReconcile))
		}
	}))
	_, _ = s.pvcInf.AddEventHandler(handler(func(obj any) {
		s.pvcQueue.Add(key(obj))
		if pvc, ok := obj.(*corev1.PersistentVolumeClaim); ok {
			s.enqueueVMIsIn(pvc.Namespace)
			s.enqueueSnapshotsOf(pvc.Namespace, pvc.Name)
		}
		s.changed.notify()
	}))
	snapEvent := func(obj any) {
		if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = t.Obj
		}
		vs, ok := obj.(*unstructured.Unstructured)
		if !ok {
			return
		}
		s.snapQueue.Add(vs.GetNamespace() + "/" + vs.GetName())
		s.enqueueRestoresOf(vs.GetNamespace(), vs.GetName())
		s.changed.notify()
	}
	_, _ = s.snapInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    snapEvent,
		UpdateFunc: func(_, n any) { snapEvent(n) },
		DeleteFunc: func(obj any) {
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = t.Obj
			}
			if vs, ok := obj.(*unstructured.Unstructured); ok {
				s.mu.Lock()
				delete(s.snapStart, vs.GetUID())
				s.mu.Unlock()
			}
			snapEvent(obj)
		},
	})
	_, _ = s.pvcInf.AddEventHandler(cache.ResourceEventHandlerFuncs{DeleteFunc: func(obj any) {
		if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = t.Obj
		}
		pvc, ok := obj.(*corev1.PersistentVolumeClaim)
		if !ok {
			return
		}
		s.mu.Lock()
		delete(s.pvcSeen, pvc.UID)
		delete(s.restoreWait, pvc.UID)
		delete(s.restored, pvc.UID)
		s.mu.Unlock()
		if pvc.Spec.VolumeName != "" && s.wantsBinding(pvc) {
			s.pvcQueue.Add(pvDeletePrefix + pvc.Spec.VolumeName)
		}
		s.enqueueVMIsIn(pvc.Namespace)
	}})
	_, _ = s.vmiInf.AddEventHandler(cache.ResourceEventHandlerFuncs{DeleteFunc: func(obj any) {
		if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = t.Obj
		}
		if vmi, ok := obj.(*kubevirtv1.VirtualMachineInstance); ok {
			s.forgetVMI(vmi.UID)
		}
	}})
	_, _ = s.podInf.AddEventHandler(cache.ResourceEventHandlerFuncs{DeleteFunc: func(obj any) {
		if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = t.Obj
		}
		if p, ok := obj.(*corev1.Pod); ok {
			s.mu.Lock()
			delete(s.pods, p.UID)
			s.mu.Unlock()
			for _, v := range p.Spec.Volumes { // a deleted claim may be free now
				if v.PersistentVolumeClaim != nil {
					s.pvcQueue.Add(p.Namespace + "/" + v.PersistentVolumeClaim.ClaimName)
				}
			}
		}
	}})
}

func (s *Sim) enqueueVMIsIn(ns string) {
	objs, _ := s.vmiInf.GetIndexer().ByIndex(cache.NamespaceIndex, ns)
	for _, o := range objs {
		vmi := o.(*kubevirtv1.VirtualMachineInstance)
		s.vmiQueue.AddAfter(vmi.Namespace+"/"+vmi.Name, s.jit.d(s.t.VMIReconcile))
	}
}

// runWorkers processes keys of q with n workers; the queue never hands one key
// to two workers at once. sync returns the delay before the next pass of the
// key (0: none) or an error (rate-limited retry).
func (s *Sim) runWorkers(ctx context.Context, q workqueue.TypedRateLimitingInterface[string], n int, sync func(context.Context, string) (time.Duration, error)) {
	for range n {
		s.goRun(func() {
			for {
				k, quit := q.Get()
				if quit {
					return
				}
				again, err := func() (time.Duration, error) {
					defer func() {
						if r := recover(); r != nil {
							s.log.Error(fmt.Errorf("panic: %v", r), "sync panicked", "key", k)
							panic(r)
						}
					}()
					return sync(ctx, k)
				}()
				switch {
				case ctx.Err() != nil:
				case err != nil:
					s.log.V(3).Info("sync failed, retrying", "key", k, "err", err)
					q.AddRateLimited(k)
				default:
					q.Forget(k)
					if again > 0 {
						q.AddAfter(k, again)
					}
				}
				q.Done(k)
			}
		})
	}
}

// notifier wakes every waiter on any VM, VMI, PVC, VolumeSnapshot or KubeVirt
// event.
type notifier struct {
	mu sync.Mutex
	ch chan struct{}
}

func (n *notifier) init() { n.ch = make(chan struct{}) }

func (n *notifier) wait() <-chan struct{} {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.ch
}

func (n *notifier) notify() {
	n.mu.Lock()
	close(n.ch)
	n.ch = make(chan struct{})
	n.mu.Unlock()
}
