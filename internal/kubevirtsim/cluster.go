package kubevirtsim

import (
	"context"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiextclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// cluster is what every simulated controller shares and only reads: the
// options, the clients, the informers of the objects they watch, the
// jittered clock and the waiters' notifier. Each controller keeps its own
// state behind its own lock.
type cluster struct {
	opts Options
	t    Timings // scaled
	feat features
	cfg  *rest.Config
	kube kubernetes.Interface
	kv   *kvClient
	ext  apiextclient.Interface
	dyn  dynamic.Interface
	jit  *jitterer
	log  klog.Logger // set by Start, before any worker runs

	vmInf, vmiInf, kvInf cache.SharedIndexInformer
	migInf               cache.SharedIndexInformer // VirtualMachineInstanceMigrations (migration.go)
	podInf, pvcInf       cache.SharedIndexInformer
	snapInf              cache.SharedIndexInformer // VolumeSnapshots (unstructured)
	vrbInf, vrrInf       cache.SharedIndexInformer // Harvester's VolumeRemoteBackups and -Restores (unstructured)
	podLister            corelisters.PodLister
	pvcLister            corelisters.PersistentVolumeClaimLister

	changed notifier
	wg      sync.WaitGroup
}

func newCluster(cfg *rest.Config, opts Options) (*cluster, error) {
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
	cl := &cluster{
		opts: opts, t: opts.Timings, feat: opts.Version.features(),
		cfg: c, kube: kube, kv: kv, ext: ext, dyn: dyn,
		jit: newJitterer(opts.Seed, opts.Jitter),
		log: klog.Background().WithName("kubevirtsim"),
	}
	cl.changed.init()
	return cl, nil
}

func (c *cluster) setupInformers() {
	ns := c.opts.Namespace
	c.vmInf = c.kv.informer(resVMs, ns, &kubevirtv1.VirtualMachine{}, &kubevirtv1.VirtualMachineList{})
	c.vmiInf = c.kv.informer(resVMIs, ns, &kubevirtv1.VirtualMachineInstance{}, &kubevirtv1.VirtualMachineInstanceList{})
	c.migInf = c.kv.informer(resMigrations, ns, &kubevirtv1.VirtualMachineInstanceMigration{}, &kubevirtv1.VirtualMachineInstanceMigrationList{})
	c.kvInf = c.kv.informer(resKubeVirts, c.opts.KubeVirtNamespace, &kubevirtv1.KubeVirt{}, &kubevirtv1.KubeVirtList{})
	podFactory := informers.NewSharedInformerFactoryWithOptions(c.kube, 0, informers.WithNamespace(ns),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = c.podSelector() }))
	c.podInf = podFactory.Core().V1().Pods().Informer()
	c.podLister = podFactory.Core().V1().Pods().Lister()
	factory := informers.NewSharedInformerFactoryWithOptions(c.kube, 0, informers.WithNamespace(ns))
	c.pvcInf = factory.Core().V1().PersistentVolumeClaims().Informer()
	c.pvcLister = factory.Core().V1().PersistentVolumeClaims().Lister()
	c.snapInf = dynamicinformer.NewFilteredDynamicInformer(c.dyn, volumeSnapshotGVR, ns, 0,
		cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}, nil).Informer()
	c.vrbInf = dynamicinformer.NewFilteredDynamicInformer(c.dyn, volumeRemoteBackupGVR, ns, 0,
		cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}, nil).Informer()
	c.vrrInf = dynamicinformer.NewFilteredDynamicInformer(c.dyn, volumeRemoteRestoreGVR, ns, 0,
		cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}, nil).Informer()
	// Waiters re-check on every change they may wait for.
	for _, inf := range []cache.SharedIndexInformer{c.vmInf, c.vmiInf, c.kvInf, c.pvcInf, c.snapInf, c.migInf} {
		_, _ = inf.AddEventHandler(onEvent(func(any) { c.changed.notify() }))
	}
}

func (c *cluster) informers() []cache.SharedIndexInformer {
	return []cache.SharedIndexInformer{c.vmInf, c.vmiInf, c.kvInf, c.podInf, c.pvcInf, c.snapInf, c.vrbInf, c.vrrInf, c.migInf}
}

func (c *cluster) hasSynced() []cache.InformerSynced {
	var out []cache.InformerSynced
	for _, inf := range c.informers() {
		out = append(out, inf.HasSynced)
	}
	return out
}

func (c *cluster) goRun(f func()) {
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		f()
	}()
}

// gates reports which hotplug machinery the KubeVirt CR enables right now:
// legacy when HotplugVolumes is listed; declarative when it is not and
// DeclarativeHotplugVolumes is listed (or, on main, by default: the gate is
// Beta there). v1.7.0 pkg/virt-controller/watch/vm/vm.go:3441 lets legacy
// win.
func (c *cluster) gates() (legacy, declarative bool) {
	obj, ok, _ := c.kvInf.GetStore().GetByKey(c.opts.KubeVirtNamespace + "/" + c.opts.KubeVirtName)
	if !ok {
		return false, false
	}
	kv := obj.(*kubevirtv1.KubeVirt)
	var fg []string
	if dc := kv.Spec.Configuration.DeveloperConfiguration; dc != nil {
		fg = dc.FeatureGates
	}
	legacy = slices.Contains(fg, GateHotplugVolumes)
	declarative = !legacy && c.feat.declarativeGate && (c.feat.declarativeByDefault || slices.Contains(fg, GateDeclarativeHotplugVolumes))
	return legacy, declarative
}

func (c *cluster) cachedVM(key string) (*kubevirtv1.VirtualMachine, bool) {
	obj, ok, _ := c.vmInf.GetStore().GetByKey(key)
	if !ok {
		return nil, false
	}
	return obj.(*kubevirtv1.VirtualMachine), true
}

func (c *cluster) cachedVMI(key string) (*kubevirtv1.VirtualMachineInstance, bool) {
	obj, ok, _ := c.vmiInf.GetStore().GetByKey(key)
	if !ok {
		return nil, false
	}
	return obj.(*kubevirtv1.VirtualMachineInstance), true
}

// pvc returns the cached claim, or nil.
func (c *cluster) pvc(ns, name string) *corev1.PersistentVolumeClaim {
	p, err := c.pvcLister.PersistentVolumeClaims(ns).Get(name)
	if err != nil {
		return nil
	}
	return p
}

// attachmentPods lists the VMI's attachment pods, newest first: those on
// its node, as KubeVirt's are those of the virt-launcher pod on
// status.nodeName (v1.7.0 pkg/controller/controller.go:321-357
// CurrentVMIPod): during a migration the target's are not yet the VMI's,
// after it the source's no longer are (migration.go). A pod no scheduler
// has placed yet counts, as it is bound for the VMI's node.
func (c *cluster) attachmentPods(vmi *kubevirtv1.VirtualMachineInstance) []*corev1.Pod {
	all, _ := c.podLister.Pods(vmi.Namespace).List(labels.SelectorFromSet(labels.Set{labelAttachmentPodVMI: vmi.Name}))
	var out []*corev1.Pod
	for _, p := range all {
		if p.Labels[labelAttachmentPod] == valueAttachmentPod && (metav1.IsControlledBy(p, vmi) || c.ownedByLauncherOf(p, vmi)) &&
			(vmi.Status.NodeName == "" || p.Spec.NodeName == "" || p.Spec.NodeName == vmi.Status.NodeName) {
			out = append(out, p)
		}
	}
	sortNewestFirst(out)
	return out
}

// eachMigrationOf calls f with the key of every cached migration of the VM
// (namespace/name key).
func (c *cluster) eachMigrationOf(vmKey string, f func(key string)) {
	ns, name, _ := cache.SplitMetaNamespaceKey(vmKey)
	objs, _ := c.migInf.GetIndexer().ByIndex(cache.NamespaceIndex, ns)
	for _, o := range objs {
		if m := o.(*kubevirtv1.VirtualMachineInstanceMigration); m.Spec.VMIName == name {
			f(m.Namespace + "/" + m.Name)
		}
	}
}

// eachVMIIn calls f with the key of every cached VMI in namespace ns.
func (c *cluster) eachVMIIn(ns string, f func(key string)) {
	objs, _ := c.vmiInf.GetIndexer().ByIndex(cache.NamespaceIndex, ns)
	for _, o := range objs {
		vmi := o.(*kubevirtv1.VirtualMachineInstance)
		f(vmi.Namespace + "/" + vmi.Name)
	}
}

// workQueue is a controller's rate-limited queue of object keys.
type workQueue struct {
	workqueue.TypedRateLimitingInterface[string]
	// limiter delays a key's retry after a failed pass.
	limiter workqueue.TypedRateLimiter[string]
}

func newWorkQueue(name string, base, maxDelay time.Duration) workQueue {
	limiter := workqueue.NewTypedItemExponentialFailureRateLimiter[string](base, max(maxDelay, base))
	return workQueue{workqueue.NewTypedRateLimitingQueueWithConfig(limiter,
		workqueue.TypedRateLimitingQueueConfig[string]{Name: "kubevirtsim-" + name}), limiter}
}

// run processes keys with n workers; the queue never hands one key to two
// workers at once. sync returns the delay before the next pass of the key
// (0: none) or an error (rate-limited retry).
func (q workQueue) run(ctx context.Context, c *cluster, n int, sync func(context.Context, string) (time.Duration, error)) {
	for range n {
		c.goRun(func() {
			for {
				k, quit := q.Get()
				if quit {
					return
				}
				again, err := sync(ctx, k)
				switch {
				case ctx.Err() != nil:
				case err != nil:
					c.log.V(3).Info("sync failed, retrying", "key", k, "err", err)
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

// objectKey is the namespace/name key of an informer object (tombstones
// included).
func objectKey(obj any) string {
	k, _ := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	return k
}

// unwrap returns the object inside a deletion tombstone.
func unwrap(obj any) any {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		return t.Obj
	}
	return obj
}

// onEvent calls f on every add, update (new object) and delete (tombstones
// unwrapped).
func onEvent(f func(obj any)) cache.ResourceEventHandlerFuncs {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    f,
		UpdateFunc: func(_, n any) { f(n) },
		DeleteFunc: func(obj any) { f(unwrap(obj)) },
	}
}

// onDelete calls f on deletes only (tombstones unwrapped).
func onDelete(f func(obj any)) cache.ResourceEventHandlerFuncs {
	return cache.ResourceEventHandlerFuncs{DeleteFunc: func(obj any) { f(unwrap(obj)) }}
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

// deadlines remembers when simulated work started, per key, so a step fires
// once its time has come however often the controller looks.
type deadlines map[string]time.Time

// at returns the deadline of key, starting it (now + d, jittered) if it is
// not running.
func (d deadlines) at(key string, now time.Time, delay time.Duration, jit *jitterer) time.Time {
	t, ok := d[key]
	if !ok {
		t = now.Add(jit.d(delay))
		d[key] = t
	}
	return t
}
