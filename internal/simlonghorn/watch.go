package simlonghorn

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
)

// byClaim indexes Longhorn volumes by the claim their PV binds
// ("namespace/name"), so that a pod's change reaches its volumes.
const byClaim = "claim"

// view is the stand-in's picture of the API server, kept by watches as
// longhorn-manager's informers keep its: Longhorn's Volumes and
// VolumeAttachments of its namespace and every pod. A pass reads nothing
// from the server; only writes (and ControllerPublish's own polls, which
// are Longhorn's) reach it.
type view struct {
	vols, vas cache.Indexer
	pods      corelisters.PodLister
	queue     workqueue.TypedRateLimitingInterface[string]
}

// watch starts the informers and returns once they have synced; every
// change queues the volumes it concerns.
func (s *Sim) watch(ctx context.Context) (*view, error) {
	dyn := dynamicinformer.NewFilteredDynamicSharedInformerFactory(s.store.dyn, 0, s.opts.Namespace, nil)
	volInf := dyn.ForResource(volumeGVR).Informer()
	vaInf := dyn.ForResource(vaGVR).Informer()
	if err := volInf.AddIndexers(cache.Indexers{byClaim: claimOfVolume}); err != nil {
		return nil, err
	}
	typed := informers.NewSharedInformerFactory(s.kube, 0)
	podInf := typed.Core().V1().Pods()
	v := &view{
		vols: volInf.GetIndexer(), vas: vaInf.GetIndexer(), pods: podInf.Lister(),
		queue: workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]()),
	}
	byName := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			_, name, _ := cache.SplitMetaNamespaceKey(key)
			v.queue.Add(name)
		}
	}
	handler := cache.ResourceEventHandlerFuncs{AddFunc: byName, UpdateFunc: func(_, o any) { byName(o) }, DeleteFunc: byName}
	if _, err := volInf.AddEventHandler(handler); err != nil {
		return nil, err
	}
	// A VolumeAttachment is named as its volume.
	if _, err := vaInf.AddEventHandler(handler); err != nil {
		return nil, err
	}
	byPod := func(obj any) { s.queuePodVolumes(v, obj) }
	if _, err := podInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: byPod, UpdateFunc: func(_, o any) { byPod(o) }, DeleteFunc: byPod,
	}); err != nil {
		return nil, err
	}
	dyn.Start(ctx.Done())
	typed.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), volInf.HasSynced, vaInf.HasSynced, podInf.Informer().HasSynced) {
		return nil, fmt.Errorf("simlonghorn: caches not synced: %w", context.Cause(ctx))
	}
	return v, nil
}

func claimOfVolume(obj any) ([]string, error) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return nil, nil
	}
	ns, _, _ := unstructured.NestedString(u.Object, "status", "kubernetesStatus", "namespace")
	pvc, _, _ := unstructured.NestedString(u.Object, "status", "kubernetesStatus", "pvcName")
	if pvc == "" {
		return nil, nil
	}
	return []string{ns + "/" + pvc}, nil
}

// queuePodVolumes queues the volumes of a pod's claims: their workloads
// lists follow it.
func (s *Sim) queuePodVolumes(v *view, obj any) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	for _, vol := range pod.Spec.Volumes {
		if vol.PersistentVolumeClaim == nil {
			continue
		}
		objs, err := v.vols.ByIndex(byClaim, pod.Namespace+"/"+vol.PersistentVolumeClaim.ClaimName)
		if err != nil {
			continue
		}
		for _, o := range objs {
			v.queue.Add(o.(*unstructured.Unstructured).GetName())
		}
	}
}

// Run reconciles until ctx ends: each volume when one of its objects or
// pods changes, and again when a stage, the workloads list's lag or a
// fault it is under comes due.
func (s *Sim) Run(ctx context.Context) {
	log := klog.FromContext(ctx)
	v, err := s.watch(ctx)
	if err != nil {
		if ctx.Err() == nil {
			log.Error(err, "Longhorn stand-in cannot watch", "namespace", s.opts.Namespace)
		}
		return
	}
	s.mu.Lock()
	s.view = v
	s.mu.Unlock()
	go func() {
		<-ctx.Done()
		v.queue.ShutDown()
	}()
	for s.next(ctx, v) {
	}
}

func (s *Sim) next(ctx context.Context, v *view) bool {
	name, quit := v.queue.Get()
	if quit {
		return false
	}
	defer v.queue.Done(name)
	err := s.reconcileOne(ctx, v, name)
	switch {
	case err == nil:
		v.queue.Forget(name)
	case ctx.Err() != nil:
		return true
	default:
		if !apierrors.IsConflict(err) {
			klog.FromContext(ctx).Error(err, "Reconcile Longhorn volume", "volume", name)
		}
		v.queue.AddRateLimited(name)
	}
	if d, ok := s.nextDue(name, time.Now()); ok {
		v.queue.AddAfter(name, d)
	}
	return true
}

// nextDue is how long until the volume's stage, workloads list or fault
// comes due, if one is pending.
func (s *Sim) nextDue(name string, now time.Time) (time.Duration, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var due []time.Time
	if st := s.stages[name]; st != nil {
		due = append(due, st.doneAt)
	}
	if l := s.lag[name]; l != nil {
		due = append(due, l.writeAt)
	}
	if until, ok := s.faulted[name]; ok && until.After(now) {
		due = append(due, until)
	}
	if len(due) == 0 {
		return 0, false
	}
	first := due[0]
	for _, t := range due[1:] {
		if t.Before(first) {
			first = t
		}
	}
	return max(first.Sub(now), 0), true
}

// reconcileOne is one pass over a volume, on what the informers hold.
func (s *Sim) reconcileOne(ctx context.Context, v *view, name string) error {
	obj, ok, err := v.vols.GetByKey(s.opts.Namespace + "/" + name)
	if err != nil || !ok {
		s.clearStage(name)
		return err
	}
	vol, err := fromU[Volume](obj.(*unstructured.Unstructured))
	if err != nil {
		return err
	}
	p := &pass{vas: map[string]*VolumeAttachment{}, pods: map[string][]corev1.Pod{}, lister: v.pods}
	if obj, ok, err := v.vas.GetByKey(s.opts.Namespace + "/" + name); err != nil {
		return err
	} else if ok {
		if p.vas[name], err = fromU[VolumeAttachment](obj.(*unstructured.Unstructured)); err != nil {
			return err
		}
	}
	return s.reconcile(ctx, p, vol)
}

// reconcileAll is one pass over every volume the informers hold, in line
// (the contract tests force passes with it).
func (s *Sim) reconcileAll(ctx context.Context) {
	s.mu.Lock()
	v := s.view
	s.mu.Unlock()
	if v == nil {
		return
	}
	for _, key := range v.vols.ListKeys() {
		_, name, _ := cache.SplitMetaNamespaceKey(key)
		if err := s.reconcileOne(ctx, v, name); err != nil && ctx.Err() == nil && !apierrors.IsConflict(err) {
			klog.FromContext(ctx).Error(err, "Reconcile Longhorn volume", "volume", name)
		}
	}
}

// podsOf lists a namespace's pods from the informer, once per pass.
func (p *pass) podsOf(ns string) ([]corev1.Pod, error) {
	if pods, ok := p.pods[ns]; ok {
		return pods, nil
	}
	l, err := p.lister.Pods(ns).List(labels.Everything())
	if err != nil {
		return nil, err
	}
	out := make([]corev1.Pod, len(l))
	for i, pod := range l {
		out[i] = *pod
	}
	p.pods[ns] = out
	return out, nil
}

// queue asks for a pass over a volume whose state changed outside the API
// (a fault, a ghost entry).
func (s *Sim) queue(name string) {
	s.mu.Lock()
	v := s.view
	s.mu.Unlock()
	if v != nil {
		v.queue.Add(name)
	}
}
