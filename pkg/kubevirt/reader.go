package kubevirt

import (
	"context"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

// Reader reads the host namespace's VMs and VMIs from the API server, not
// from a cache, decoded in full (ClaimReader is the light variant the
// hotplug queue uses).
type Reader struct{ c *host.Client }

// NewReader returns a Reader over c.
func NewReader(c *host.Client) *Reader { return &Reader{c: c} }

// VMExists reads the VM from the API server, not from a cache.
func (r *Reader) VMExists(ctx context.Context, vm string) (bool, error) {
	_, err := r.c.KubeVirt.KubevirtV1().VirtualMachines(r.c.Namespace).Get(ctx, vm, metav1.GetOptions{})
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
func (r *Reader) ListVMs(ctx context.Context) ([]kubevirtv1.VirtualMachine, error) {
	l, err := r.c.KubeVirt.KubevirtV1().VirtualMachines(r.c.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	return l.Items, nil
}

// ListVMIs lists the namespace's VMIs from the API server with a quorum read.
func (r *Reader) ListVMIs(ctx context.Context) ([]kubevirtv1.VirtualMachineInstance, error) {
	l, err := r.c.KubeVirt.KubevirtV1().VirtualMachineInstances(r.c.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	return l.Items, nil
}
