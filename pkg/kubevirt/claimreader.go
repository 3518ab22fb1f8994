package kubevirt

import (
	"context"
	"time"

	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// ClaimReader is the hotplug queue's view of the API server (hotplug.Reader).
// Its VM and VMI lists are the quorum reads the queue makes before every
// exclusive attach, of the whole namespace: at 50 VMs with 20 volumes each
// that is about a megabyte of JSON per batch, and decoding it into complete
// KubeVirt objects was half of the controller's CPU. They are decoded like
// the informers' objects (pkg/host lean.go), into the fields the queue reads.
type ClaimReader struct{ c *host.Client }

// NewClaimReader returns the hotplug queue's reader over c.
func NewClaimReader(c *host.Client) *ClaimReader { return &ClaimReader{c: c} }

// VMExists reads the VM from the API server, not from a cache.
func (r *ClaimReader) VMExists(ctx context.Context, vm string) (bool, error) {
	return NewReader(r.c).VMExists(ctx, vm)
}

// Claim reads a host PVC and its reservation from the API server.
func (r *ClaimReader) Claim(ctx context.Context, claim string) (hotplug.HostClaim, error) {
	return r.c.Claim(ctx, claim)
}

// Reserve writes a reservation on a host PVC if it has not changed since it
// was read.
func (r *ClaimReader) Reserve(ctx context.Context, from hotplug.HostClaim, res hotplug.Reservation) (hotplug.HostClaim, error) {
	return r.c.Reserve(ctx, from, res)
}

// ListVMs lists the namespace's VMs with a quorum read (no resourceVersion),
// so the answer includes every write made before it.
func (r *ClaimReader) ListVMs(ctx context.Context) ([]kubevirtv1.VirtualMachine, error) {
	return r.c.LiveVMs(ctx)
}

// ListVMIs lists the namespace's VMIs with a quorum read.
func (r *ClaimReader) ListVMIs(ctx context.Context) ([]kubevirtv1.VirtualMachineInstance, error) {
	return r.c.LiveVMIs(ctx)
}

// LiveLaunchers reads the virt-launcher pods of the VM's VMI that may still
// run.
func (r *ClaimReader) LiveLaunchers(ctx context.Context, vm string, vmi types.UID) (map[types.UID]bool, error) {
	return r.c.LiveLaunchers(ctx, vm, vmi)
}

// WakeVM makes KubeVirt's VM controller look at the VM now.
func (r *ClaimReader) WakeVM(ctx context.Context, vm string, at time.Time) error {
	return r.c.WakeVM(ctx, vm, at)
}
