package host

import (
	"context"
	"encoding/json"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// WokenAtAnnotation records on a VM when the driver last woke KubeVirt's VM
// controller for it (WakeVM).
const WokenAtAnnotation = "driver.harvesterhci.io/hotplug-woken-at"

// WakeVM makes KubeVirt's VM controller look at the VM now. A controller
// whose updates of a VM failed many times in a row (each conflict with a
// request virt-api queued meanwhile) waits out a backoff that doubles from
// 5 ms to 1000 s (client-go's default controller rate limiter, kubevirt
// v1.7.0 pkg/virt-controller/watch/vm/vm.go:151-153, 345-347), and only an
// event of the VM or its VMI cuts it short (an update enqueues the VM at
// once, vm.go:2269-2281); once the writes stop, the VM's queued requests
// wait out that backoff. Changing an annotation is such an event and
// touches neither spec nor status. It needs patch on virtualmachines in
// the namespace, which the host identity has (docs/host-rbac.md).
func (c *Client) WakeVM(ctx context.Context, vm string, at time.Time) error {
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{
		WokenAtAnnotation: at.UTC().Format(time.RFC3339Nano),
	}}})
	if err != nil {
		return err
	}
	_, err = c.KubeVirt.KubevirtV1().VirtualMachines(c.Namespace).Patch(ctx, vm, types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}
