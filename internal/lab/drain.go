package lab

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
)

// faultDrainNode names a guest node's drain in the log and the report.
const faultDrainNode = "drain-guest-node"

// drainUpgrade is how long a drained guest node stays cordoned once its
// pods are gone (scaled): the upgrade itself, rke2 restarting on it.
const drainUpgrade = 20 * time.Second

// drainBound bounds the wait for a drained node's pods to be gone
// (scaled); a pod still there after it is logged and the roll goes on.
const drainBound = 2 * time.Minute

// startDrains is the --drain-nodes fault: every period the guest nodes are
// rolled one after another, as an RKE2 upgrade through Rancher does (its
// system-upgrade-controller drains one node at a time and uncordons it once
// rke2 is upgraded there; Harvester issue 10889 wedged during such a roll).
// Each node is cordoned, every pod on it that no DaemonSet owns is evicted
// through the Eviction API (kubectl drain --ignore-daemonsets) and awaited,
// the node stays cordoned for the upgrade, then it is uncordoned. A Job's
// evicted pod is replaced elsewhere; a database pinned to the node waits,
// Pending, for the uncordon: its volume leaves the VM and comes back.
func (r *run) startDrains(ctx context.Context, every func(time.Duration, func())) {
	if r.c.DrainNodesEvery <= 0 {
		return
	}
	every(r.c.DrainNodesEvery, func() {
		r.log.Info("fault: rolling the guest nodes, one drain at a time", "nodes", len(r.nodes))
		for _, node := range r.nodes {
			if ctx.Err() != nil {
				return
			}
			r.drainNode(ctx, node)
		}
	})
}

// drainNode drains one guest node and uncordons it, on a context the run's
// end does not cancel for the uncordon: a node left cordoned would keep its
// pinned pods Pending through the quiesce.
func (r *run) drainNode(ctx context.Context, node string) {
	kube := r.g.Kube
	if err := cordonNode(ctx, kube, node, true); err != nil {
		r.log.Error(err, "fault: could not cordon the guest node", "node", node)
		return
	}
	ev := FaultEvent{Fault: faultDrainNode, Target: node, Start: time.Now()}
	i := r.recordFault(ev)
	r.log.Info("fault starts", "fault", faultDrainNode, "target", node)
	evicted, err := evictNode(ctx, kube, node, r.c.scaled(time.Second))
	if err != nil && ctx.Err() == nil {
		r.log.Error(err, "fault: draining the guest node", "node", node)
	}
	r.log.Info("fault: guest node drained", "node", node, "evicted", len(evicted))
	gone := awaitPodsGone(ctx, kube, node, evicted, r.c.scaled(time.Second), r.c.scaled(drainBound))
	if !gone && ctx.Err() == nil {
		r.log.Info("fault: evicted pods still on the guest node after the bound, uncordoning anyway", "node", node, "bound", r.c.scaled(drainBound))
	}
	select {
	case <-ctx.Done():
	case <-time.After(r.c.scaled(drainUpgrade)):
	}
	if err := cordonNode(context.WithoutCancel(ctx), kube, node, false); err != nil {
		r.log.Error(err, "fault: could not uncordon the guest node", "node", node)
		return
	}
	r.log.Info("fault ends", "fault", faultDrainNode, "target", node, "after", time.Since(ev.Start).Round(time.Millisecond))
	r.mu.Lock()
	r.faults[i].End = time.Now()
	r.mu.Unlock()
}

func cordonNode(ctx context.Context, kube kubernetes.Interface, node string, on bool) error {
	patch := fmt.Appendf(nil, `{"spec":{"unschedulable":%t}}`, on)
	_, err := kube.CoreV1().Nodes().Patch(ctx, node, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
	return err
}

// evictNode evicts every pod on node that no DaemonSet owns and that is not
// done or already going, as kubectl drain --ignore-daemonsets does; an
// eviction refused for now (429: a disruption budget) is asked again every
// poll. It returns the pods evicted.
func evictNode(ctx context.Context, kube kubernetes.Interface, node string, poll time.Duration) ([]types.UID, error) {
	pods, err := kube.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", node).String()})
	if err != nil {
		return nil, err
	}
	var evicted []types.UID
	for _, p := range pods.Items {
		if p.Spec.NodeName != node || !drainable(&p) {
			continue
		}
		ev := &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace},
			DeleteOptions: &metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &p.UID}}}
		err := wait.PollUntilContextCancel(ctx, poll, true, func(ctx context.Context) (bool, error) {
			err := kube.CoreV1().Pods(p.Namespace).EvictV1(ctx, ev)
			switch {
			case err == nil, apierrors.IsNotFound(err), apierrors.IsConflict(err):
				return true, nil // evicted, or gone (or replaced) meanwhile
			case apierrors.IsTooManyRequests(err):
				return false, nil
			default:
				return false, err
			}
		})
		if err != nil {
			return evicted, fmt.Errorf("evict %s/%s: %w", p.Namespace, p.Name, err)
		}
		evicted = append(evicted, p.UID)
	}
	return evicted, nil
}

// drainable says whether kubectl drain --ignore-daemonsets would evict p.
func drainable(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
		return false
	}
	if _, mirror := p.Annotations[corev1.MirrorPodAnnotationKey]; mirror {
		return false
	}
	ref := metav1.GetControllerOf(p)
	return ref == nil || ref.Kind != "DaemonSet"
}

// awaitPodsGone waits until none of the pods uids is on node any more, at
// most for bound; it says whether they went.
func awaitPodsGone(ctx context.Context, kube kubernetes.Interface, node string, uids []types.UID, poll, bound time.Duration) bool {
	if len(uids) == 0 {
		return true
	}
	want := map[types.UID]bool{}
	for _, u := range uids {
		want[u] = true
	}
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	err := wait.PollUntilContextCancel(ctx, poll, true, func(ctx context.Context) (bool, error) {
		pods, err := kube.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{
			FieldSelector: fields.OneTermEqualSelector("spec.nodeName", node).String()})
		if err != nil {
			return false, nil
		}
		for _, p := range pods.Items {
			if p.Spec.NodeName == node && want[p.UID] {
				return false, nil
			}
		}
		return true, nil
	})
	return err == nil
}
