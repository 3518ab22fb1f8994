package kubevirtsim

import (
	"context"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
)

// kubelet plays the scheduler, the attach/detach controller and kubelet
// for attachment pods: a pod starts (Running and Ready) Timings.PodStart
// after every claim it mounts is bound, and stays Pending while one is not
// (the scheduler does not place a pod with an unbound immediate claim); a
// deleted pod is gone Timings.PodDelete later.
type kubelet struct {
	c      *cluster
	faults *Faults
	queue  workQueue

	mu   sync.Mutex
	pods map[types.UID]*podMem
}

// podMem is kubelet's memory of one attachment pod.
type podMem struct {
	startAt  time.Time
	deleteAt time.Time
}

func newKubelet(c *cluster, f *Faults) *kubelet {
	return &kubelet{c: c, faults: f, queue: newWorkQueue("pod", c.t.BackoffBase, c.t.HandlerPoll), pods: map[types.UID]*podMem{}}
}

func (k *kubelet) register() {
	_, _ = k.c.podInf.AddEventHandler(onEvent(func(obj any) { k.queue.Add(objectKey(obj)) }))
	_, _ = k.c.podInf.AddEventHandler(onDelete(func(obj any) {
		if p, ok := obj.(*corev1.Pod); ok {
			k.mu.Lock()
			delete(k.pods, p.UID)
			k.mu.Unlock()
		}
	}))
	// A claim that binds lets the pods waiting for it be scheduled.
	_, _ = k.c.pvcInf.AddEventHandler(onEvent(func(obj any) {
		pvc, ok := obj.(*corev1.PersistentVolumeClaim)
		if !ok {
			return
		}
		pods, _ := k.c.podLister.Pods(pvc.Namespace).List(labels.Everything())
		for _, p := range pods {
			if slices.Contains(podClaims(p), pvc.Name) {
				k.queue.Add(p.Namespace + "/" + p.Name)
			}
		}
	}))
}

func (k *kubelet) run(ctx context.Context) { k.queue.run(ctx, k.c, 2, k.sync) }
func (k *kubelet) shutdown()               { k.queue.ShutDown() }

// enqueueVM looks at the VM's attachment pods again.
func (k *kubelet) enqueueVM(namespace, vm string) {
	pods, _ := k.c.podLister.Pods(namespace).List(labels.SelectorFromSet(labels.Set{labelAttachmentPodVMI: vm}))
	for _, p := range pods {
		k.queue.Add(p.Namespace + "/" + p.Name)
	}
}

func podClaims(p *corev1.Pod) []string {
	var out []string
	for _, v := range p.Spec.Volumes {
		if v.PersistentVolumeClaim != nil {
			out = append(out, v.PersistentVolumeClaim.ClaimName)
		}
	}
	return out
}

func (k *kubelet) sync(ctx context.Context, key string) (time.Duration, error) {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	p, err := k.c.podLister.Pods(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	k.mu.Lock()
	mem := k.pods[p.UID]
	if mem == nil {
		mem = &podMem{}
		k.pods[p.UID] = mem
	}
	k.mu.Unlock()
	now := time.Now()
	if p.DeletionTimestamp != nil {
		k.mu.Lock()
		if mem.deleteAt.IsZero() {
			mem.deleteAt = now.Add(k.c.jit.d(k.c.t.PodDelete))
		}
		at := mem.deleteAt
		k.mu.Unlock()
		if now.Before(at) {
			return at.Sub(now), nil
		}
		err := k.c.kube.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0), Preconditions: &metav1.Preconditions{UID: ptr.To(p.UID)}})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			return 0, err
		}
		k.c.log.V(3).Info("attachment pod gone", "pod", key)
		return 0, nil
	}
	if p.Status.Phase == corev1.PodRunning {
		return 0, nil
	}
	if k.faults.podsStuck(ns + "/" + p.Labels[labelAttachmentPodVMI]) {
		return 0, nil // SetAttachmentPodsStuck(false) requeues
	}
	for _, claim := range podClaims(p) {
		if pvc := k.c.pvc(ns, claim); pvc == nil || pvc.Status.Phase != corev1.ClaimBound {
			k.c.log.V(3).Info("attachment pod unschedulable: claim not bound", "pod", key, "claim", claim)
			return 0, nil // the claim's events requeue
		}
	}
	k.mu.Lock()
	if mem.startAt.IsZero() {
		mem.startAt = now.Add(k.c.jit.d(k.c.t.PodStart))
	}
	at := mem.startAt
	k.mu.Unlock()
	if now.Before(at) {
		return at.Sub(now), nil
	}
	upd := p.DeepCopy()
	t := metav1.Now()
	upd.Status.Phase = corev1.PodRunning
	upd.Status.StartTime = &t
	upd.Status.HostIP = "192.168.122.10"
	upd.Status.PodIP = "10.52.0.2"
	upd.Status.Conditions = []corev1.PodCondition{
		{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: t},
		{Type: corev1.PodInitialized, Status: corev1.ConditionTrue, LastTransitionTime: t},
		{Type: corev1.ContainersReady, Status: corev1.ConditionTrue, LastTransitionTime: t},
		{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: t},
	}
	upd.Status.ContainerStatuses = []corev1.ContainerStatus{{
		Name: "hotplug-disk", Image: p.Spec.Containers[0].Image, Ready: true, Started: ptr.To(true),
		State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: t}},
	}}
	if _, err := k.c.kube.CoreV1().Pods(ns).UpdateStatus(ctx, upd, metav1.UpdateOptions{}); err != nil {
		if apierrors.IsNotFound(err) {
			return 0, nil
		}
		return 0, err
	}
	k.c.log.V(2).Info("attachment pod running", "pod", key, "vm", ns+"/"+p.Labels[labelAttachmentPodVMI])
	return 0, nil
}
