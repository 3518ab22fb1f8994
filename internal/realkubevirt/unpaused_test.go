package realkubevirt

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// On a control plane without KubeVirt PR 15599 (v1.6.0) the node agents
// keep the launcher pod's unpaused condition as v1.6.1 and later write it:
// True while the VMI runs unpaused, False while it is paused, with a
// strategic merge patch that keeps the kubelet's other conditions; on a
// fixed control plane they leave the pod alone.
func TestUnpausedConditionAsTheFixedReleaseWritesIt(t *testing.T) {
	for _, tag := range []string{"v1.6.0", "v1.7.0"} {
		t.Run(tag, func(t *testing.T) {
			vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "vm", Namespace: "guests", UID: "vmi-uid"},
				Status: kubevirtv1.VirtualMachineInstanceStatus{Phase: kubevirtv1.Running, NodeName: "harvester-0"}}
			launcher := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "virt-launcher-vm-x", Namespace: "guests", UID: "launcher-uid",
				Labels: map[string]string{kubevirtv1.AppLabel: launcherLabelValue, kubevirtv1.CreatedByLabel: "vmi-uid"}},
				Spec: corev1.PodSpec{NodeName: "harvester-0"},
				Status: corev1.PodStatus{Phase: corev1.PodRunning, Conditions: []corev1.PodCondition{
					{Type: corev1.ContainersReady, Status: corev1.ConditionTrue, ObservedGeneration: 1}}}}
			kube := fake.NewClientset(launcher)
			a := testAgents(t, kube, []string{"harvester-0"}, launcher)
			a.pausedConditionFixed = pausedConditionFixed(tag)
			ctx := context.Background()
			check := func(want corev1.ConditionStatus) {
				t.Helper()
				pod, err := kube.CoreV1().Pods("guests").Get(ctx, launcher.Name, metav1.GetOptions{})
				if err != nil {
					t.Fatal(err)
				}
				if err := a.pods.Update(pod); err != nil {
					t.Fatal(err)
				}
				got, kept := corev1.ConditionStatus(""), false
				for _, c := range pod.Status.Conditions {
					if c.Type == kubevirtv1.VirtualMachineUnpaused {
						got = c.Status
					}
					kept = kept || c.Type == corev1.ContainersReady && c.ObservedGeneration == 1
				}
				if a.pausedConditionFixed {
					want = ""
				}
				if got != want || !kept {
					t.Errorf("unpaused condition %q, conditions %+v; want %q and the kubelet's kept", got, pod.Status.Conditions, want)
				}
			}
			if err := a.syncUnpausedCondition(ctx, vmi); err != nil {
				t.Fatal(err)
			}
			check(corev1.ConditionTrue)
			vmi.Status.Conditions = []kubevirtv1.VirtualMachineInstanceCondition{{Type: kubevirtv1.VirtualMachineInstancePaused, Status: corev1.ConditionTrue}}
			if err := a.syncUnpausedCondition(ctx, vmi); err != nil {
				t.Fatal(err)
			}
			check(corev1.ConditionFalse)
		})
	}
}
