package realkubevirt

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/realkubevirt/podview"
	"github.com/harvester-csi/harvester-csi-driver/internal/virthandler"
)

// Pod labels virt-controller gives virt-launcher and attachment pods
// (v1.7.0 pkg/virt-controller/services/template.go).
const (
	launcherLabelValue   = "virt-launcher"
	attachmentLabelValue = "hotplug-disk"
)

// nodeAgents play the host nodes for KubeVirt: the kubelet for its pods and
// virt-handler for its VMIs. Everything else is the real control plane's.
type nodeAgents struct {
	kube      kubernetes.Interface
	kv        kubevirt.Interface // admin, for reads
	handlerKV kubevirt.Interface // virt-handler's identity, for VMI writes
	nodes     []string

	pods  cache.Indexer
	vmis  cache.Indexer
	queue workqueue.TypedRateLimitingInterface[item]
	// handler is virt-handler as the release ships it, the same model the
	// simulated control plane runs: its state outlives status writes
	// because virt-handler decides from the node, not from the status it
	// wrote.
	handler *virthandler.Handler

	mu     sync.Mutex
	passes map[string]int // per VMI key: virt-handler passes, for tests
	// kubelets: real kubelets and a scheduler run the pods; syncPod stands
	// aside.
	kubelets bool
	// pausedConditionFixed: the control plane writes the launcher pod's
	// unpaused condition itself (unpaused.go).
	pausedConditionFixed bool

	// Live migration (migration.go): the transfers per migration, the VMs
	// whose transfer is held, how long a transfer takes, and how a source
	// virt-launcher's containers end.
	transfers    map[types.UID]*transfer
	held         map[string]bool
	transferTime time.Duration
	launchers    LauncherExit
}

// DiskHook lets the host attach something real (a loop device, say) as
// virt-handler hot-plugs a volume (internal/virthandler DiskHook): Plug runs
// as the domain takes the disk, Unplug as it lets it go; an error fails
// virt-handler's pass, to be tried again. Its method set is the simulator's
// disk hook's, so one implementation serves both hosts.
type DiskHook = virthandler.DiskHook

type item struct {
	pod       bool
	namespace string
	name      string
}

func newNodeAgents(kube kubernetes.Interface, kv, handlerKV kubevirt.Interface, nodes []string, handler *virthandler.Handler) *nodeAgents {
	return &nodeAgents{
		kube: kube, kv: kv, handlerKV: handlerKV, nodes: nodes, handler: handler,
		// virt-handler's queue (v1.7.0 pkg/virt-handler/vm.go:145): 5 ms
		// doubling to 1000 s per key.
		queue:     workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[item]()),
		passes:    map[string]int{},
		transfers: map[types.UID]*transfer{}, held: map[string]bool{},
		transferTime: migrationTransfer,
	}
}

// passCount is how many hotplug passes virt-handler made over a VMI.
func (a *nodeAgents) passCount(namespace, name string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.passes[namespace+"/"+name]
}

// run watches KubeVirt's pods and the VMIs and syncs them, one at a time so
// virt-handler's mount state needs no lock, until ctx ends.
func (a *nodeAgents) run(ctx context.Context) {
	defer a.queue.ShutDown()
	factory := informers.NewSharedInformerFactoryWithOptions(a.kube, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.LabelSelector = kubevirtv1.AppLabel + " in (" + launcherLabelValue + "," + attachmentLabelValue + ")"
	}))
	podInf := factory.Core().V1().Pods().Informer()
	a.pods = podInf.GetIndexer()
	vmiInf := cache.NewSharedIndexInformer(
		cache.NewListWatchFromClient(a.kv.KubevirtV1().RESTClient(), "virtualmachineinstances", metav1.NamespaceAll, fields.Everything()),
		&kubevirtv1.VirtualMachineInstance{}, 0, cache.Indexers{})
	a.vmis = vmiInf.GetIndexer()
	enqueue := func(pod bool) cache.ResourceEventHandler {
		add := func(obj any) {
			if m, err := metaOf(obj); err == nil {
				a.queue.Add(item{pod: pod, namespace: m.GetNamespace(), name: m.GetName()})
			}
		}
		return cache.ResourceEventHandlerFuncs{AddFunc: add, UpdateFunc: func(_, n any) { add(n) }}
	}
	if _, err := podInf.AddEventHandler(enqueue(true)); err != nil {
		klog.ErrorS(err, "node agents: pod handler")
		return
	}
	if _, err := vmiInf.AddEventHandler(enqueue(false)); err != nil {
		klog.ErrorS(err, "node agents: VMI handler")
		return
	}
	factory.Start(ctx.Done())
	go vmiInf.Run(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), podInf.HasSynced, vmiInf.HasSynced) {
		return
	}
	go func() {
		<-ctx.Done()
		a.queue.ShutDown()
	}()
	for a.next(ctx) {
	}
}

// requeueVMI has virt-handler look at a VMI now.
func (a *nodeAgents) requeueVMI(namespace, name string) {
	a.queue.Add(item{namespace: namespace, name: name})
}

func metaOf(obj any) (metav1.Object, error) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	m, ok := obj.(metav1.Object)
	if !ok {
		return nil, fmt.Errorf("unexpected object %T", obj)
	}
	return m, nil
}

func (a *nodeAgents) next(ctx context.Context) bool {
	it, quit := a.queue.Get()
	if quit {
		return false
	}
	defer a.queue.Done(it)
	callCtx, cancel := context.WithTimeout(ctx, syncTimeout)
	defer cancel()
	var err error
	if it.pod {
		err = a.syncPod(callCtx, it.namespace, it.name)
	} else {
		err = a.syncVMI(callCtx, it.namespace, it.name)
	}
	switch {
	case err == nil:
		a.queue.Forget(it)
	case ctx.Err() != nil:
	default:
		// A conflict is the normal race with virt-controller: retry on
		// the newer object, as the real agents do.
		if !apierrors.IsConflict(err) {
			klog.V(2).InfoS("node agent sync failed, retrying", "namespace", it.namespace, "name", it.name, "pod", it.pod, "err", err)
		}
		a.queue.AddRateLimited(it)
	}
	return true
}

// syncPod is the kubelet: it binds an unscheduled pod, reports a bound one
// Running with every container ready, and finishes a deletion at once (no
// containers to stop).
func (a *nodeAgents) syncPod(ctx context.Context, namespace, name string) error {
	if a.kubelets {
		return nil
	}
	obj, ok, err := a.pods.GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return err
	}
	pod := obj.(*corev1.Pod)
	podKey := klog.KRef(namespace, name)
	switch {
	case podFinished(pod) && pod.DeletionTimestamp == nil:
		return nil // a virt-launcher that exited after its migration
	case pod.DeletionTimestamp != nil:
		zero := int64(0)
		err := a.kube.CoreV1().Pods(namespace).Delete(ctx, name, metav1.DeleteOptions{
			GracePeriodSeconds: &zero, Preconditions: &metav1.Preconditions{UID: &pod.UID},
		})
		if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
			return nil
		}
		return err
	case pod.Spec.NodeName == "":
		node, err := a.nodeFor(pod)
		if err != nil {
			return err
		}
		klog.V(3).InfoS("kubelet stand-in binds pod", "pod", podKey, "node", node)
		return a.kube.CoreV1().Pods(namespace).Bind(ctx, &corev1.Binding{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, UID: pod.UID},
			Target:     corev1.ObjectReference{Kind: "Node", Name: node},
		}, metav1.CreateOptions{})
	case pod.Status.Phase != corev1.PodRunning:
		running := pod.DeepCopy()
		running.Status = runningStatus(pod)
		_, err := a.kube.CoreV1().Pods(namespace).UpdateStatus(ctx, running, metav1.UpdateOptions{})
		return err
	}
	return nil
}

// nodeFor places an attachment pod on its virt-launcher's node, as its
// required node affinity demands (the launcher pod is its owner), and a
// launcher pod on one of the nodes, spread by name.
func (a *nodeAgents) nodeFor(pod *corev1.Pod) (string, error) {
	if pod.Labels[kubevirtv1.AppLabel] == attachmentLabelValue {
		for _, ref := range pod.OwnerReferences {
			if ref.Kind != "Pod" {
				continue
			}
			obj, ok, err := a.pods.GetByKey(pod.Namespace + "/" + ref.Name)
			if err != nil {
				return "", err
			}
			if ok && obj.(*corev1.Pod).Spec.NodeName != "" {
				return obj.(*corev1.Pod).Spec.NodeName, nil
			}
		}
		return "", fmt.Errorf("attachment pod %s/%s: its virt-launcher pod is not bound yet", pod.Namespace, pod.Name)
	}
	h := 0
	for _, c := range pod.Name {
		h = h*31 + int(c)
	}
	if h < 0 {
		h = -h
	}
	return a.nodes[h%len(a.nodes)], nil
}

func runningStatus(pod *corev1.Pod) corev1.PodStatus {
	now := metav1.Now()
	st := corev1.PodStatus{
		Phase:     corev1.PodRunning,
		HostIP:    "127.0.0.1",
		PodIP:     "127.0.0.1",
		StartTime: &now,
	}
	for _, t := range []corev1.PodConditionType{corev1.PodScheduled, corev1.PodInitialized, corev1.ContainersReady, corev1.PodReady} {
		st.Conditions = append(st.Conditions, corev1.PodCondition{Type: t, Status: corev1.ConditionTrue, LastTransitionTime: now})
	}
	for _, c := range pod.Spec.InitContainers {
		st.InitContainerStatuses = append(st.InitContainerStatuses, corev1.ContainerStatus{
			Name: c.Name, Image: c.Image, Ready: true,
			State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{Reason: "Completed", StartedAt: now, FinishedAt: now}},
		})
	}
	started := true
	for _, c := range pod.Spec.Containers {
		st.ContainerStatuses = append(st.ContainerStatuses, corev1.ContainerStatus{
			Name: c.Name, Image: c.Image, Ready: true, Started: &started,
			State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}},
		})
	}
	return st
}

// syncVMI is virt-handler for one VMI on a node: it starts the domain of a
// scheduled VMI, runs virt-handler's hotplug pass over a running one
// (internal/virthandler) and writes the status it answers, and shuts a
// deleted one down. Like virt-handler, it PUTs the whole VMI: its role may
// update VMIs but not patch them.
func (a *nodeAgents) syncVMI(ctx context.Context, namespace, name string) error {
	obj, ok, err := a.vmis.GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return err
	}
	vmi := obj.(*kubevirtv1.VirtualMachineInstance).DeepCopy()
	if vmi.Status.NodeName == "" || vmi.IsFinal() {
		if vmi.IsFinal() {
			return a.shutDown(ctx, vmi)
		}
		return nil
	}
	before := vmi.DeepCopy()
	if vmi.DeletionTimestamp == nil {
		changed, wake, err := a.syncMigration(ctx, vmi)
		if wake > 0 {
			a.queue.AddAfter(item{namespace: namespace, name: name}, wake)
		}
		switch {
		case err != nil:
			return err
		case changed:
			klog.V(3).InfoS("virt-handler stand-in updates a migrating VMI", "vmi", klog.KObj(vmi), "node", vmi.Status.NodeName)
			_, err := a.handlerKV.KubevirtV1().VirtualMachineInstances(namespace).Update(ctx, vmi, metav1.UpdateOptions{})
			return err
		case transferring(vmi):
			return nil
		}
	}
	var passErr error
	switch {
	case vmi.DeletionTimestamp != nil:
		if err := a.shutDown(ctx, vmi); err != nil {
			return err
		}
		vmi.Status.Phase = kubevirtv1.Succeeded
	case vmi.Status.Phase == kubevirtv1.Scheduled:
		startDomain(vmi)
	case vmi.Status.Phase == kubevirtv1.Running:
		a.mu.Lock()
		a.passes[namespace+"/"+name]++
		a.mu.Unlock()
		res := a.handler.Sync(ctx, vmi, a.attachmentPods(vmi), time.Now())
		if err := virthandler.RecordEvents(ctx, a.kube, vmi, res.Events); err != nil {
			klog.V(2).InfoS("virt-handler stand-in: events not recorded", "vmi", klog.KObj(vmi), "err", err)
		}
		if res.Wake > 0 {
			a.queue.AddAfter(item{namespace: namespace, name: name}, res.Wake)
		}
		if res.Entries == nil { // delayed on an I/O error: nothing written
			return nil
		}
		vmi.Status.VolumeStatus = res.Entries
		vmi.Status.Conditions = virthandler.PausedCondition(vmi.Status.Conditions, res.PausedIOError, time.Now())
		passErr = res.Err
	}
	if vmi.DeletionTimestamp == nil && vmi.Status.Phase == kubevirtv1.Running {
		if err := a.syncUnpausedCondition(ctx, vmi); err != nil {
			return err
		}
	}
	if equalStatus(before, vmi) {
		return passErr
	}
	klog.V(3).InfoS("virt-handler stand-in updates VMI", "vmi", klog.KObj(vmi), "phase", vmi.Status.Phase)
	if _, err := a.handlerKV.KubevirtV1().VirtualMachineInstances(namespace).Update(ctx, vmi, metav1.UpdateOptions{}); err != nil {
		return err
	}
	// A failed pass still wrote its status, then goes back to the
	// rate-limited queue (v1.7.0 pkg/virt-handler/vm.go:1477-1495).
	return passErr
}

// attachmentPods are the VMI's attachment pods as virt-handler finds them:
// owned by a virt-launcher pod of the VMI, holding the volumes their pod
// volumes are named after (v1.7.0 pkg/virt-controller/services/
// template.go:1042-1050).
func (a *nodeAgents) attachmentPods(vmi *kubevirtv1.VirtualMachineInstance) []virthandler.Pod {
	pods, err := a.namespacePods(vmi.Namespace)
	if err != nil {
		return nil
	}
	// Only the pods of the VMI's node: virt-handler finds an attachment
	// pod's devices under its own node's kubelet directory, so during and
	// after a migration the other node's pods offer none.
	launchers := map[string]bool{}
	for _, p := range pods {
		if isLauncherOn(p, vmi, vmi.Status.NodeName) {
			launchers[p.Name] = true
		}
	}
	var out []virthandler.Pod
	for _, p := range pods {
		if p.Labels[kubevirtv1.AppLabel] != attachmentLabelValue || !slices.ContainsFunc(p.OwnerReferences, func(r metav1.OwnerReference) bool { return r.Kind == "Pod" && launchers[r.Name] }) {
			continue
		}
		if !a.kubelets {
			// The stand-in starts a pod the moment it binds it: every
			// volume it lists is there.
			out = append(out, podview.AllVolumes(p))
			continue
		}
		out = append(out, podview.HandlerPod(p))
	}
	return out
}

// namespacePods are the pods of a namespace in the agents' cache.
func (a *nodeAgents) namespacePods(namespace string) ([]*corev1.Pod, error) {
	objs, err := a.pods.ByIndex(cache.NamespaceIndex, namespace)
	if err != nil {
		return nil, err
	}
	pods := make([]*corev1.Pod, 0, len(objs))
	for _, o := range objs {
		pods = append(pods, o.(*corev1.Pod))
	}
	return pods, nil
}

// isLauncherOn tells whether p is a virt-launcher pod of vmi on node.
func isLauncherOn(p *corev1.Pod, vmi *kubevirtv1.VirtualMachineInstance, node string) bool {
	return p.Labels[kubevirtv1.AppLabel] == launcherLabelValue && p.Labels[kubevirtv1.CreatedByLabel] == string(vmi.UID) &&
		p.Spec.NodeName == node
}

// shutDown unplugs a stopping VMI's disks and forgets its mounts: a domain
// that ends takes its hot-plugged disks with it.
func (a *nodeAgents) shutDown(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) error {
	if err := a.handler.Shutdown(ctx, vmi); err != nil {
		return err
	}
	a.handler.Forget(vmi.UID)
	return nil
}

// startDomain writes what virt-handler reports once the domain runs. The
// SELinux context matters beyond display: virt-controller builds attachment
// pods from it and creates none while it is empty (v1.7.0
// pkg/virt-controller/services/template.go:1403).
func startDomain(vmi *kubevirtv1.VirtualMachineInstance) {
	vmi.Status.Phase = kubevirtv1.Running
	vmi.Status.SelinuxContext = "none"
	now := metav1.Now()
	for i, c := range vmi.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineInstanceReady {
			vmi.Status.Conditions[i].Status = corev1.ConditionTrue
			vmi.Status.Conditions[i].LastTransitionTime = now
			return
		}
	}
	vmi.Status.Conditions = append(vmi.Status.Conditions, kubevirtv1.VirtualMachineInstanceCondition{
		Type: kubevirtv1.VirtualMachineInstanceReady, Status: corev1.ConditionTrue, LastTransitionTime: now,
	})
}

func equalStatus(a, b *kubevirtv1.VirtualMachineInstance) bool {
	// Condition timestamps differ on every write; compare the rest.
	x, y := a.Status.DeepCopy(), b.Status.DeepCopy()
	for _, s := range []*kubevirtv1.VirtualMachineInstanceStatus{x, y} {
		for i := range s.Conditions {
			s.Conditions[i].LastTransitionTime = metav1.Time{}
		}
	}
	return apiequality.Semantic.DeepEqual(x, y)
}

// syncTimeout bounds one API call of the agents, so a stalled server cannot
// wedge the queue.
const syncTimeout = 30 * time.Second
