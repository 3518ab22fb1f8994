package differential

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"
)

// bootVolume is the one volume every VM of both hosts boots from; it is not a
// hotplug and stays out of the recorded states.
const bootVolume = "rootdisk"

// facets are what is recorded per scenario, each a sequence of its own:
// the VM, the VMI (phase and spec), each hotplug volume's volumeStatus
// entry, and the attachment pods. KubeVirt's controllers and the node
// agents write these from different goroutines, so how the sequences
// interleave is timing; the order within one is behaviour.
type facets struct {
	VM, VMI []string
	Entries map[string][]string
	Pods    []string
}

func (f facets) clone() facets {
	c := facets{VM: slices.Clone(f.VM), VMI: slices.Clone(f.VMI), Pods: slices.Clone(f.Pods), Entries: map[string][]string{}}
	for k, v := range f.Entries {
		c.Entries[k] = slices.Clone(v)
	}
	return c
}

// trace is what a scenario observed on one control plane.
type trace struct {
	seq     facets
	final   []string // the VM, VMI and pods once settled
	answers []string
	notes   []string
}

// recorder collects the states of one VM and its attachment pods as the
// observer's informers deliver them.
type recorder struct {
	vm   string
	vols []string // the scenario's volumes: its pods are the ones holding them

	mu      sync.Mutex
	seq     facets
	answers []string
	notes   []string // logged, not compared
}

func (r *recorder) note(s string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	push(&r.notes, s)
}

func (r *recorder) holds(p *corev1.Pod) bool {
	return slices.ContainsFunc(podVolumes(p), func(v string) bool { return slices.Contains(r.vols, v) })
}

func push(list *[]string, s string) {
	if n := len(*list); n > 0 && (*list)[n-1] == s {
		return // consecutive duplicates collapse: only changes count
	}
	*list = append(*list, s)
}

// answer records what the API said to one write; the same answer to a
// retry of it collapses into one.
func (r *recorder) answer(step string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	push(&r.answers, step+": "+normAnswer(err))
}

func (r *recorder) trace(final []string) trace {
	r.mu.Lock()
	defer r.mu.Unlock()
	return trace{seq: r.seq.clone(), final: final, answers: slices.Clone(r.answers), notes: slices.Clone(r.notes)}
}

// observer watches one host namespace's VMs, VMIs and attachment pods and
// hands every change to the scenario's recorder. It keeps the objects as
// the events delivered them, not the informers' caches: a cache may already
// hold a later state when the handler of an event runs, and a state seen
// only for a moment (a pod between its deletion timestamp and its removal)
// would then be missed at random.
type observer struct {
	ns string

	mu   sync.Mutex
	rec  *recorder
	vms  map[string]*kubevirtv1.VirtualMachine
	vmis map[string]*kubevirtv1.VirtualMachineInstance
	pods map[string]*corev1.Pod
}

func startObserver(ctx context.Context, kube kubernetes.Interface, kv kubevirt.Interface, ns string) (*observer, error) {
	o := &observer{ns: ns, vms: map[string]*kubevirtv1.VirtualMachine{}, vmis: map[string]*kubevirtv1.VirtualMachineInstance{}, pods: map[string]*corev1.Pod{}}
	factory := informers.NewSharedInformerFactoryWithOptions(kube, 0, informers.WithNamespace(ns),
		informers.WithTweakListOptions(func(lo *metav1.ListOptions) { lo.LabelSelector = kubevirtv1.AppLabel + "=hotplug-disk" }))
	podInf := factory.Core().V1().Pods().Informer()
	vmInf := cache.NewSharedIndexInformer(cache.NewListWatchFromClient(kv.KubevirtV1().RESTClient(), "virtualmachines", ns, fields.Everything()),
		&kubevirtv1.VirtualMachine{}, 0, cache.Indexers{})
	vmiInf := cache.NewSharedIndexInformer(cache.NewListWatchFromClient(kv.KubevirtV1().RESTClient(), "virtualmachineinstances", ns, fields.Everything()),
		&kubevirtv1.VirtualMachineInstance{}, 0, cache.Indexers{})
	for _, inf := range []cache.SharedIndexInformer{podInf, vmInf, vmiInf} {
		// One informer's handler sees its events one at a time, in order.
		if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    func(obj any) { o.event(obj, false) },
			UpdateFunc: func(_, obj any) { o.event(obj, false) },
			DeleteFunc: func(obj any) { o.event(obj, true) },
		}); err != nil {
			return nil, err
		}
	}
	factory.Start(ctx.Done())
	go vmInf.Run(ctx.Done())
	go vmiInf.Run(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), podInf.HasSynced, vmInf.HasSynced, vmiInf.HasSynced) {
		return nil, errors.New("observer: caches did not sync")
	}
	return o, nil
}

func (o *observer) event(obj any, gone bool) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj, gone = t.Obj, true
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	switch x := obj.(type) {
	case *kubevirtv1.VirtualMachine:
		o.vms[x.Name] = x
		if gone {
			delete(o.vms, x.Name)
		}
	case *kubevirtv1.VirtualMachineInstance:
		o.vmis[x.Name] = x
		if gone {
			delete(o.vmis, x.Name)
		}
	case *corev1.Pod:
		o.pods[x.Name] = x
		if gone {
			delete(o.pods, x.Name)
		}
	}
	o.recordLocked()
}

// follow makes rec the recorder of the changes to come, starting with the
// state now.
func (o *observer) follow(rec *recorder) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.rec = rec
	o.recordLocked()
}

func (o *observer) recordLocked() {
	rec := o.rec
	if rec == nil {
		return
	}
	vm, vmi, pods := o.objectsLocked(rec)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	push(&rec.seq.VM, vmState(vm))
	push(&rec.seq.VMI, vmiState(vmi))
	if rec.seq.Entries == nil {
		rec.seq.Entries = map[string][]string{}
	}
	for _, v := range rec.vols {
		list := rec.seq.Entries[v]
		push(&list, entryState(vmi, v))
		rec.seq.Entries[v] = list
	}
	push(&rec.seq.Pods, podsState(pods))
}

// state is the normalised VM, VMI (with every entry) and pods of rec.
func (o *observer) state(rec *recorder) []string {
	vm, vmi, pods := o.objects(rec)
	entries := make([]string, len(rec.vols))
	for i, v := range rec.vols {
		entries[i] = v + ": " + entryState(vmi, v)
	}
	return []string{vmState(vm), vmiState(vmi), strings.Join(entries, "; "), podsState(pods)}
}

// objects are rec's VM and VMI (nil when absent) and the attachment pods
// that hold one of its volumes.
func (o *observer) objects(rec *recorder) (*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance, []*corev1.Pod) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.objectsLocked(rec)
}

func (o *observer) objectsLocked(rec *recorder) (*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance, []*corev1.Pod) {
	var pods []*corev1.Pod
	for _, p := range o.pods {
		if rec.holds(p) {
			pods = append(pods, p)
		}
	}
	return o.vms[rec.vm], o.vmis[rec.vm], pods
}

// vmState: the hotplug volumes of the VM spec, in order, and its pending
// volume requests.
func vmState(vm *kubevirtv1.VirtualMachine) string {
	if vm == nil {
		return "no VM"
	}
	var spec []string
	if vm.Spec.Template != nil {
		for _, v := range vm.Spec.Template.Spec.Volumes {
			if v.Name != bootVolume {
				spec = append(spec, v.Name)
			}
		}
	}
	var reqs []string
	for _, r := range vm.Status.VolumeRequests {
		switch {
		case r.AddVolumeOptions != nil:
			reqs = append(reqs, "add "+r.AddVolumeOptions.Name)
		case r.RemoveVolumeOptions != nil:
			reqs = append(reqs, "remove "+r.RemoveVolumeOptions.Name)
		}
	}
	return fmt.Sprintf("spec [%s] requests [%s]", strings.Join(spec, " "), strings.Join(reqs, ", "))
}

// vmiState: whether the VMI exists (and is going), its phase and its
// spec's hotplug volumes.
func vmiState(vmi *kubevirtv1.VirtualMachineInstance) string {
	if vmi == nil {
		return "no VMI"
	}
	phase := vmi.Status.Phase
	if phase == "" {
		// KubeVirt's mutating webhook gives a new VMI phase Pending (v1.7.0
		// vmi-mutator.go:116); the simulator's VMI is born without one and
		// made Pending by its controller's first pass (lab.md lists it).
		phase = kubevirtv1.Pending
	}
	head := "VMI " + string(phase)
	if vmi.DeletionTimestamp != nil {
		head += " deleting"
	}
	return fmt.Sprintf("%s spec [%s]", head, strings.Join(hotplugNames(vmi.Spec.Volumes), " "))
}

// entryState: a volume's volumeStatus entry, its phase and whether it names
// an attachment pod.
func entryState(vmi *kubevirtv1.VirtualMachineInstance, vol string) string {
	if vmi == nil {
		return "no VMI"
	}
	for _, e := range vmi.Status.VolumeStatus {
		if e.Name != vol {
			continue
		}
		s := string(e.Phase)
		if e.HotplugVolume != nil && e.HotplugVolume.AttachPodUID != "" {
			s += " +pod"
		}
		return s
	}
	return "no entry"
}

// podsState: each attachment pod as its volumes and whether it runs, is
// still starting, or is terminating; sorted, since pod names are random.
func podsState(pods []*corev1.Pod) string {
	var out []string
	for _, p := range pods {
		state := "starting"
		switch {
		case p.DeletionTimestamp != nil:
			state = "terminating"
		case p.Status.Phase == corev1.PodRunning:
			state = "running"
		}
		out = append(out, strings.Join(podVolumes(p), "+")+" "+state)
	}
	sort.Strings(out)
	return "pods [" + strings.Join(out, ", ") + "]"
}

// podVolumes are the claims an attachment pod holds (the driver names a
// hotplug volume after its claim), sorted.
func podVolumes(p *corev1.Pod) []string {
	var vols []string
	for _, v := range p.Spec.Volumes {
		if v.PersistentVolumeClaim != nil {
			vols = append(vols, v.PersistentVolumeClaim.ClaimName)
		}
	}
	sort.Strings(vols)
	return vols
}

var (
	uidRE = regexp.MustCompile(`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`)
	rvRE  = regexp.MustCompile(`(?i)(resourceVersion[^0-9]*)[0-9]+`)
)

// normAnswer is an API answer as compared: the HTTP code and the message
// without object UIDs and resource versions, which differ by run.
func normAnswer(err error) string {
	if err == nil {
		return "ok"
	}
	code := int32(0)
	var st apierrors.APIStatus
	if errors.As(err, &st) {
		code = st.Status().Code
	}
	msg := uidRE.ReplaceAllString(err.Error(), "<uid>")
	msg = rvRE.ReplaceAllString(msg, "${1}<rv>")
	return fmt.Sprintf("%d %s", code, msg)
}
