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

// facets are the three things recorded per scenario. Each is a sequence of
// its own: KubeVirt writes the VM, the VMI and the pods from different
// goroutines, so how their events interleave is timing, while the order of
// one object's states is behaviour.
type facets struct {
	VM, VMI, Pods []string
}

// trace is what a scenario observed on one control plane.
type trace struct {
	seq     facets
	final   facets // the last state of each, once settled
	answers []string
}

// recorder collects the states of one VM and its attachment pods as the
// observer's informers deliver them.
type recorder struct {
	vm   string
	vols map[string]bool // the scenario's volumes: its pods are the ones holding them

	mu      sync.Mutex
	seq     facets
	answers []string
}

func (r *recorder) push(list *[]string, s string) {
	if n := len(*list); n > 0 && (*list)[n-1] == s {
		return // consecutive duplicates collapse: only changes count
	}
	*list = append(*list, s)
}

// answer records what the API said to one write.
func (r *recorder) answer(step string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.answers = append(r.answers, step+": "+normAnswer(err))
}

func (r *recorder) trace(final facets) trace {
	r.mu.Lock()
	defer r.mu.Unlock()
	return trace{seq: facets{slices.Clone(r.seq.VM), slices.Clone(r.seq.VMI), slices.Clone(r.seq.Pods)}, final: final, answers: slices.Clone(r.answers)}
}

// observer watches one host namespace's VMs, VMIs and attachment pods and
// hands every change to the scenario's recorder.
type observer struct {
	ns        string
	vms, vmis cache.Indexer
	pods      cache.Indexer

	mu  sync.Mutex
	rec *recorder
}

func startObserver(ctx context.Context, kube kubernetes.Interface, kv kubevirt.Interface, ns string) (*observer, error) {
	o := &observer{ns: ns}
	factory := informers.NewSharedInformerFactoryWithOptions(kube, 0, informers.WithNamespace(ns),
		informers.WithTweakListOptions(func(lo *metav1.ListOptions) { lo.LabelSelector = kubevirtv1.AppLabel + "=hotplug-disk" }))
	podInf := factory.Core().V1().Pods().Informer()
	vmInf := cache.NewSharedIndexInformer(cache.NewListWatchFromClient(kv.KubevirtV1().RESTClient(), "virtualmachines", ns, fields.Everything()),
		&kubevirtv1.VirtualMachine{}, 0, cache.Indexers{})
	vmiInf := cache.NewSharedIndexInformer(cache.NewListWatchFromClient(kv.KubevirtV1().RESTClient(), "virtualmachineinstances", ns, fields.Everything()),
		&kubevirtv1.VirtualMachineInstance{}, 0, cache.Indexers{})
	o.pods, o.vms, o.vmis = podInf.GetIndexer(), vmInf.GetIndexer(), vmiInf.GetIndexer()
	for _, inf := range []cache.SharedIndexInformer{podInf, vmInf, vmiInf} {
		// Handlers run one event at a time per informer, after the cache
		// holds it: each call records the state that event made.
		h := func(any) { o.record() }
		if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc: h, UpdateFunc: func(_, n any) { h(n) }, DeleteFunc: h,
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

// follow makes rec the recorder of the changes to come, starting with the
// state now.
func (o *observer) follow(rec *recorder) {
	o.mu.Lock()
	o.rec = rec
	o.mu.Unlock()
	o.record()
}

func (o *observer) record() {
	o.mu.Lock()
	rec := o.rec
	o.mu.Unlock()
	if rec == nil {
		return
	}
	f := o.state(rec)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	rec.push(&rec.seq.VM, f.VM[0])
	rec.push(&rec.seq.VMI, f.VMI[0])
	rec.push(&rec.seq.Pods, f.Pods[0])
}

// state is the normalised state of rec's VM, VMI and pods, one entry each.
func (o *observer) state(rec *recorder) facets {
	vm, vmi, pods := o.objects(rec)
	return facets{VM: []string{vmState(vm)}, VMI: []string{vmiState(vmi)}, Pods: []string{podsState(pods)}}
}

// objects are rec's VM and VMI (nil when absent) and the attachment pods
// that hold one of its volumes, as the caches have them.
func (o *observer) objects(rec *recorder) (*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance, []*corev1.Pod) {
	key := o.ns + "/" + rec.vm
	var vm *kubevirtv1.VirtualMachine
	if obj, ok, _ := o.vms.GetByKey(key); ok {
		vm = obj.(*kubevirtv1.VirtualMachine)
	}
	var vmi *kubevirtv1.VirtualMachineInstance
	if obj, ok, _ := o.vmis.GetByKey(key); ok {
		vmi = obj.(*kubevirtv1.VirtualMachineInstance)
	}
	var pods []*corev1.Pod
	for _, obj := range o.pods.List() {
		p := obj.(*corev1.Pod)
		if slices.ContainsFunc(podVolumes(p), func(v string) bool { return rec.vols[v] }) {
			pods = append(pods, p)
		}
	}
	return vm, vmi, pods
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

// vmiState: whether the VMI exists (and is going), its spec's hotplug
// volumes, and per volumeStatus entry its phase and whether it names an
// attachment pod. Entries are sorted by name: their order in the list is
// not part of KubeVirt's contract.
func vmiState(vmi *kubevirtv1.VirtualMachineInstance) string {
	if vmi == nil {
		return "no VMI"
	}
	var spec []string
	for _, v := range vmi.Spec.Volumes {
		if v.Name != bootVolume {
			spec = append(spec, v.Name)
		}
	}
	var entries []string
	for _, e := range vmi.Status.VolumeStatus {
		if e.Name == bootVolume {
			continue
		}
		s := e.Name + " " + string(e.Phase)
		if e.HotplugVolume != nil && e.HotplugVolume.AttachPodUID != "" {
			s += " +pod"
		}
		entries = append(entries, s)
	}
	sort.Strings(entries)
	head := "VMI " + string(vmi.Status.Phase)
	if vmi.DeletionTimestamp != nil {
		head += " deleting"
	}
	return fmt.Sprintf("%s spec [%s] status [%s]", head, strings.Join(spec, " "), strings.Join(entries, ", "))
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
