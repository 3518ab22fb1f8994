package host

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// launcherSelector picks KubeVirt's virt-launcher pods: virt-controller
// labels each `kubevirt.io=virt-launcher` and makes its VMI the pod's
// controller (kubevirt v1.7.0 pkg/virt-controller/services/template.go,
// podLabels and the pod's OwnerReferences).
const launcherSelector = kubevirtv1.AppLabel + "=virt-launcher"

// LiveLauncherPods lists the virt-launcher pods of the VM's VMIs, of any
// UID, whose containers may still run (phase neither Succeeded nor Failed),
// read from the API server. The VMI is matched by its controller reference
// rather than by `vm.kubevirt.io/name`, which holds the guest's hostname.
func (c *Client) LiveLauncherPods(ctx context.Context, vm string) ([]string, error) {
	pods, err := c.liveLaunchers(ctx, vm)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(pods))
	for i, p := range pods {
		names[i] = p.Name
	}
	return names, nil
}

// LiveLaunchers is LiveLauncherPods of one VMI (by its UID, which
// virt-controller puts in each launcher pod's `kubevirt.io/created-by`
// label, kubevirt v1.7.0 pkg/virt-controller/services/template.go:1612), by pod
// UID: the hotplug queue compares them with the VMI's status.activePods,
// which names every pod the VMI controls, those that ended included.
func (c *Client) LiveLaunchers(ctx context.Context, vm string, vmi types.UID) (map[types.UID]bool, error) {
	pods, err := c.liveLaunchers(ctx, vm, kubevirtv1.CreatedByLabel+"="+string(vmi))
	if err != nil {
		return nil, err
	}
	live := make(map[types.UID]bool, len(pods))
	for _, p := range pods {
		live[p.UID] = true
	}
	return live, nil
}

func (c *Client) liveLaunchers(ctx context.Context, vm string, selectors ...string) ([]corev1.Pod, error) {
	sel := launcherSelector
	for _, s := range selectors {
		sel += "," + s
	}
	pods, err := c.Kube.CoreV1().Pods(c.Namespace).List(ctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		return nil, fmt.Errorf("list the virt-launcher pods of VM %s: %w", vm, err)
	}
	var live []corev1.Pod
	for _, p := range pods.Items {
		ref := metav1.GetControllerOf(&p)
		if ref == nil || ref.Kind != "VirtualMachineInstance" || ref.Name != vm {
			continue
		}
		if p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed {
			live = append(live, p)
		}
	}
	return live, nil
}

// GuestStopped reads the VM's VMI and its virt-launcher pods from the API
// server and reports whether the guest is known to be stopped: no VMI, or a
// VMI that ended (Succeeded, Failed or being deleted, and not Unknown), and
// no launcher pod whose containers may run. why says what decided it.
func (c *Client) GuestStopped(ctx context.Context, vm string) (stopped bool, why string, err error) {
	vmi, err := c.KubeVirt.KubevirtV1().VirtualMachineInstances(c.Namespace).Get(ctx, vm, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		vmi = nil
	case err != nil:
		return false, "", fmt.Errorf("read the VMI of VM %s: %w", vm, err)
	}
	state := hotplug.GuestStateOf(vmi)
	if state != hotplug.GuestAbsent && state != hotplug.GuestEnded {
		return false, "VMI " + state.String() + " (phase " + string(vmi.Status.Phase) + ")", nil
	}
	live, err := c.LiveLauncherPods(ctx, vm)
	if err != nil {
		return false, "", err
	}
	if len(live) > 0 {
		return false, fmt.Sprintf("VMI %s but virt-launcher pods %v may still run", state, live), nil
	}
	if vmi == nil {
		return true, "no VMI and no virt-launcher pod", nil
	}
	return true, fmt.Sprintf("VMI %s (phase %s) and no virt-launcher pod", state, vmi.Status.Phase), nil
}
