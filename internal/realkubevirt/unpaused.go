package realkubevirt

import (
	"context"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// pausedConditionFixed says whether the control plane of tag writes the
// virt-launcher pod's kubevirt.io/virtual-machine-unpaused condition in a
// way a 1.34+ kubelet's pods accept. v1.6.0 patches the pod's conditions
// with a JSON patch that tests the whole list as its k8s.io/api v0.32
// decodes it (pkg/virt-controller/watch/vmi/lifecycle.go:772-809), which
// drops the observedGeneration these kubelets write, so the test fails for
// good: the launcher pod never gets its readiness gate, and a paused VMI's
// pass returns before it writes any volume status. v1.6.1 on (kubevirt PR
// 15599, release-1.6 PR 15683; v1.6.3 lifecycle.go:775-816) sends a
// strategic merge patch, as do v1.7.0 and later.
func pausedConditionFixed(tag string) bool { return tag != "v1.6.0" }

// syncUnpausedCondition writes, for a control plane without that fix, the
// launcher pod's unpaused condition as the fixed virt-controller would:
// True while the VMI is not paused, False while it is, with a strategic
// merge patch of the pod's status. virt-controller v1.6.0 then finds the
// condition as it wants it and patches nothing. This stands for the
// release Harvester runs (1.7 ships v1.6.3), not for v1.6.0 itself.
func (a *nodeAgents) syncUnpausedCondition(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) error {
	if a.pausedConditionFixed || vmi.Status.NodeName == "" {
		return nil
	}
	pods, err := a.namespacePods(vmi.Namespace)
	if err != nil {
		return err
	}
	var pod *corev1.Pod
	for _, p := range pods {
		if isLauncherOn(p, vmi, vmi.Status.NodeName) && !podFinished(p) {
			pod = p
		}
	}
	if pod == nil {
		return nil
	}
	want := corev1.PodCondition{Type: kubevirtv1.VirtualMachineUnpaused, Status: corev1.ConditionTrue,
		Reason: "NotPaused", Message: "the virtual machine is not paused"}
	if vmiPaused(vmi) {
		want.Status, want.Reason, want.Message = corev1.ConditionFalse, "Paused", "the virtual machine is paused"
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == want.Type && c.Status == want.Status {
			return nil
		}
	}
	now := metav1.Now()
	want.LastProbeTime, want.LastTransitionTime = now, now
	patch, err := json.Marshal(map[string]any{"status": map[string]any{"conditions": []corev1.PodCondition{want}}})
	if err != nil {
		return err
	}
	klog.V(3).InfoS("node agents write the launcher pod's unpaused condition as KubeVirt v1.6.1 and later do", "pod", klog.KObj(pod), "status", want.Status)
	if _, err := a.kube.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
		return fmt.Errorf("unpaused condition of %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return nil
}

func vmiPaused(vmi *kubevirtv1.VirtualMachineInstance) bool {
	for _, c := range vmi.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineInstancePaused && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}
