package realkubevirt

import (
	"context"
	"fmt"
	"slices"
	"strings"
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
	// mounted is virt-handler's own state: which hotplug volumes of a VMI
	// it has mounted into virt-launcher. It outlives status writes because
	// virt-handler decides from the node, not from the status it wrote.
	mounted map[types.UID]map[string]bool
	// disks, when set, follow each volume into and out of the guest.
	disks DiskHook
	// kubelets: real kubelets and a scheduler run the pods; syncPod stands
	// aside.
	kubelets bool
}

// DiskHook lets the host attach something real (a loop device, say) as the
// virt-handler stand-in hot-plugs a volume: vm is "namespace/name". Plug runs
// just before an entry turns Ready, and an error keeps it MountedToPod until
// a later sync; Unplug runs as a volume that left the spec is unmounted, and
// an error keeps it mounted until a later sync. Its method set is the
// simulator's disk hook's, so one implementation serves both hosts.
type DiskHook interface {
	Plug(ctx context.Context, vm, volume, claimName string) error
	Unplug(ctx context.Context, vm, volume string) error
}

type item struct {
	pod       bool
	namespace string
	name      string
}

func newNodeAgents(kube kubernetes.Interface, kv, handlerKV kubevirt.Interface, nodes []string, disks DiskHook) *nodeAgents {
	return &nodeAgents{
		kube: kube, kv: kv, handlerKV: handlerKV, nodes: nodes, disks: disks,
		queue:   workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[item]()),
		mounted: map[types.UID]map[string]bool{},
	}
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
// scheduled VMI, mounts each hotplug volume once virt-controller has pointed
// it at a running attachment pod, attaches it to the domain (a target), and
// detaches and unmounts a volume that left the spec. Like virt-handler, it
// PUTs the whole VMI: its role may update VMIs but not patch them.
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
	switch {
	case vmi.DeletionTimestamp != nil:
		if err := a.shutDown(ctx, vmi); err != nil {
			return err
		}
		vmi.Status.Phase = kubevirtv1.Succeeded
	case vmi.Status.Phase == kubevirtv1.Scheduled:
		startDomain(vmi)
	case vmi.Status.Phase == kubevirtv1.Running:
		a.hotplug(ctx, vmi)
	}
	if equalStatus(before, vmi) {
		return nil
	}
	klog.V(3).InfoS("virt-handler stand-in updates VMI", "vmi", klog.KObj(vmi), "phase", vmi.Status.Phase)
	_, err = a.handlerKV.KubevirtV1().VirtualMachineInstances(namespace).Update(ctx, vmi, metav1.UpdateOptions{})
	return err
}

// shutDown forgets a stopping VMI's mounts, unplugging each disk first: a
// domain that ends takes its hot-plugged disks with it.
func (a *nodeAgents) shutDown(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) error {
	for volume, on := range a.mounted[vmi.UID] {
		if on && !a.unplug(ctx, vmi, volume) {
			return fmt.Errorf("VMI %s/%s: disk %s not unplugged", vmi.Namespace, vmi.Name, volume)
		}
		a.mounted[vmi.UID][volume] = false
	}
	delete(a.mounted, vmi.UID)
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

// hotplug advances each hotplug volume's entry one step per sync, the way
// virt-handler's updateHotplugVolumeStatus does (v1.7.0
// pkg/virt-handler/vm.go:474): mounted and in the spec becomes MountedToPod,
// then Ready with a target once the domain has the disk; out of the spec,
// the disk is detached (no target) and unmounted, then UnMountedFromPod.
func (a *nodeAgents) hotplug(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) {
	mounted := a.mounted[vmi.UID]
	if mounted == nil {
		mounted = map[string]bool{}
		a.mounted[vmi.UID] = mounted
	}
	for i := range vmi.Status.VolumeStatus {
		e := &vmi.Status.VolumeStatus[i]
		if e.HotplugVolume == nil {
			continue
		}
		inSpec := slices.ContainsFunc(vmi.Spec.Volumes, func(v kubevirtv1.Volume) bool { return v.Name == e.Name })
		switch {
		case inSpec && !mounted[e.Name] && e.HotplugVolume.AttachPodUID != "":
			mounted[e.Name] = true
		case inSpec && mounted[e.Name] && e.Phase == kubevirtv1.HotplugVolumeMounted && e.Target == "":
			if a.plug(ctx, vmi, e.Name) {
				e.Target = freeTarget(vmi.Status.VolumeStatus)
			}
		case !inSpec:
			e.Target = ""
			mounted[e.Name] = mounted[e.Name] && !a.unplug(ctx, vmi, e.Name)
		}
		handlerPhase(e, inSpec, mounted[e.Name])
	}
}

// plug runs the disk hook as the domain gets the disk; false keeps the
// entry MountedToPod, to be tried again at the next sync.
func (a *nodeAgents) plug(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, volume string) bool {
	if a.disks == nil {
		return true
	}
	vm := vmi.Namespace + "/" + vmi.Name
	if err := a.disks.Plug(ctx, vm, volume, claimOf(vmi.Spec.Volumes, volume)); err != nil {
		klog.FromContext(ctx).Error(err, "virt-handler stand-in: disk hook cannot plug, retrying", "vmi", klog.KObj(vmi), "volume", volume)
		a.queue.AddAfter(item{namespace: vmi.Namespace, name: vmi.Name}, hookRetry)
		return false
	}
	return true
}

// unplug runs the disk hook for a mounted volume that left the spec; false
// keeps it mounted (and so not UnMountedFromPod), to be tried again.
func (a *nodeAgents) unplug(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, volume string) bool {
	if a.disks == nil || !a.mounted[vmi.UID][volume] {
		return true
	}
	if err := a.disks.Unplug(ctx, vmi.Namespace+"/"+vmi.Name, volume); err != nil {
		klog.FromContext(ctx).Error(err, "virt-handler stand-in: disk hook cannot unplug, retrying", "vmi", klog.KObj(vmi), "volume", volume)
		a.queue.AddAfter(item{namespace: vmi.Namespace, name: vmi.Name}, hookRetry)
		return false
	}
	return true
}

// claimOf is the PVC behind a VMI volume (a DataVolume's claim has its name).
func claimOf(vols []kubevirtv1.Volume, name string) string {
	for _, v := range vols {
		if v.Name != name {
			continue
		}
		switch {
		case v.PersistentVolumeClaim != nil:
			return v.PersistentVolumeClaim.ClaimName
		case v.DataVolume != nil:
			return v.DataVolume.Name
		}
	}
	return name
}

// hookRetry paces a failing disk hook: no watch event would bring the VMI
// back, since nothing changed in the API.
const hookRetry = 200 * time.Millisecond

// handlerPhase moves an entry only from the phases virt-handler's guards
// allow (v1.7.0 pkg/virt-handler/vm.go:443 and 447).
func handlerPhase(e *kubevirtv1.VolumeStatus, inSpec, mounted bool) {
	switch {
	case e.Target != "":
		e.Phase, e.Reason = kubevirtv1.VolumeReady, "VolumeReady"
		e.Message = fmt.Sprintf("Successfully attach hotplugged volume %s to VM", e.Name)
	case mounted && inSpec && (e.Phase == kubevirtv1.VolumeBound || e.Phase == kubevirtv1.VolumePending || e.Phase == kubevirtv1.HotplugVolumeAttachedToNode):
		e.Phase, e.Reason = kubevirtv1.HotplugVolumeMounted, "VolumeMountedToPod"
		e.Message = fmt.Sprintf("Volume %s has been mounted in virt-launcher pod", e.Name)
	case !mounted && !inSpec && (e.Phase == kubevirtv1.VolumeReady || e.Phase == kubevirtv1.HotplugVolumeMounted || e.Phase == kubevirtv1.HotplugVolumeAttachedToNode):
		e.Phase, e.Reason = kubevirtv1.HotplugVolumeUnMounted, "VolumeUnMountedFromPod"
		e.Message = fmt.Sprintf("Volume %s has been unmounted from virt-launcher pod", e.Name)
	}
}

// freeTarget is the first SCSI name (sda, sdb, ...) no entry uses, as the
// domain names hot-plugged SCSI disks.
func freeTarget(entries []kubevirtv1.VolumeStatus) string {
	used := map[string]bool{}
	for _, e := range entries {
		used[e.Target] = true
	}
	for i := 0; ; i++ {
		t := "sd" + diskLetters(i)
		if !used[t] {
			return t
		}
	}
}

// diskLetters is the kernel's disk suffix: a..z, aa..az, ...
func diskLetters(i int) string {
	var b strings.Builder
	for ; i >= 0; i = i/26 - 1 {
		b.WriteByte(byte('a' + i%26))
	}
	r := []byte(b.String())
	slices.Reverse(r)
	return string(r)
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
