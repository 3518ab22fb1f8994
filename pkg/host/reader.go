package host

import (
	"context"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// VMExists reads the VM from the API server, not from a cache.
func (c *Client) VMExists(ctx context.Context, vm string) (bool, error) {
	_, err := c.KubeVirt.KubevirtV1().VirtualMachines(c.Namespace).Get(ctx, vm, metav1.GetOptions{})
	switch {
	case err == nil:
		return true, nil
	case apierrors.IsNotFound(err):
		return false, nil
	default:
		return false, err
	}
}

// ListVMs lists the namespace's VMs from the API server with a quorum read
// (no resourceVersion), so the answer includes every write made before it.
func (c *Client) ListVMs(ctx context.Context) ([]kubevirtv1.VirtualMachine, error) {
	l, err := c.KubeVirt.KubevirtV1().VirtualMachines(c.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	return l.Items, nil
}

// ListVMIs lists the namespace's VMIs from the API server with a quorum read.
func (c *Client) ListVMIs(ctx context.Context) ([]kubevirtv1.VirtualMachineInstance, error) {
	l, err := c.KubeVirt.KubevirtV1().VirtualMachineInstances(c.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	return l.Items, nil
}
