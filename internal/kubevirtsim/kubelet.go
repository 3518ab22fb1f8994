package kubevirtsim

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
)

// podMem is the fake kubelet's memory of one attachment pod.
type podMem struct {
	startAt  time.Time
	deleteAt time.Time
}

func (s *Sim) podMemFor(uid types.UID) *podMem {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := s.pods[uid]
	if m == nil {
		m = &podMem{}
		s.pods[uid] = m
	}
	return m
}

// syncPod plays kubelet (and the scheduler and CSI attach) for attachment
// pods: Running and Ready PodStart after creation unless the VM's pods are
// stuck; gone PodDelete after deletion started.
func (s *Sim) syncPod(ctx context.Context, key string) (time.Duration, error) {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	p, err := s.podLister.Pods(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	mem := s.podMemFor(p.UID)
	now := time.Now()
	if p.DeletionTimestamp != nil {
		s.mu.Lock()
		if mem.deleteAt.IsZero() {
			mem.deleteAt = now.Add(s.jit.d(s.t.PodDelete))
		}
		at := mem.deleteAt
		s.mu.Unlock()
		if now.Before(at) {
			return at.Sub(now), nil
		}
		err := s.kube.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0), Preconditions: &metav1.Preconditions{UID: ptr.To(p.UID)}})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			return 0, err
		}
		s.log.V(3).Info("attachment pod gone", "pod", key)
		return 0, nil
	}
	if p.Status.Phase == corev1.PodRunning {
		return 0, nil
	}
	if s.faults.isPodStuck(ns + "/" + p.Labels[LabelAttachmentPodVMI]) {
		return 0, nil // SetAttachmentPodsStuck(false) requeues
	}
	s.mu.Lock()
	if mem.startAt.IsZero() {
		mem.startAt = now.Add(s.jit.d(s.t.PodStart))
	}
	at := mem.startAt
	s.mu.Unlock()
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
	if _, err := s.kube.CoreV1().Pods(ns).UpdateStatus(ctx, upd, metav1.UpdateOptions{}); err != nil {
		if apierrors.IsNotFound(err) {
			return 0, nil
		}
		return 0, err
	}
	s.log.V(2).Info("attachment pod running", "pod", key, "vm", ns+"/"+p.Labels[LabelAttachmentPodVMI])
	return 0, nil
}
