package host

import (
	"context"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// Subresource hot-plugs through virt-api's addvolume/removevolume on the VM,
// one call at a time (the queue already serializes per VM). It is the only
// path that works while KubeVirt's legacy HotplugVolumes gate is on.
type Subresource struct {
	c *Client
}

// NewSubresource returns the subresource backend.
func NewSubresource(c *Client) *Subresource { return &Subresource{c: c} }

// Name implements hotplug.Backend.
func (s *Subresource) Name() string { return "subresource" }

// Exists implements hotplug.Backend.
func (s *Subresource) Exists(ctx context.Context, vm string) (bool, error) {
	return vmExists(ctx, s.c, vm)
}

// Apply implements hotplug.Backend.
func (s *Subresource) Apply(ctx context.Context, vm string, changes []hotplug.Change) []hotplug.Outcome {
	vms := s.c.KubeVirt.KubevirtV1().VirtualMachines(s.c.Namespace)
	outs := make([]hotplug.Outcome, len(changes))
	for i, ch := range changes {
		var err error
		if ch.Op == hotplug.Attach {
			err = vms.AddVolume(ctx, vm, addVolumeOptions(ch.Volume))
		} else {
			err = vms.RemoveVolume(ctx, vm, &kubevirtv1.RemoveVolumeOptions{Name: ch.Volume})
		}
		outs[i] = classify(err, ch.Op)
		if outs[i].Result == hotplug.VMGone {
			for j := i + 1; j < len(changes); j++ {
				outs[j] = outs[i]
			}
			break
		}
	}
	return outs
}

func addVolumeOptions(volume string) *kubevirtv1.AddVolumeOptions {
	return &kubevirtv1.AddVolumeOptions{
		Name: volume,
		Disk: &kubevirtv1.Disk{
			Name:       volume,
			DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusSCSI}},
		},
		VolumeSource: &kubevirtv1.HotplugVolumeSource{
			PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
				PersistentVolumeClaimVolumeSource: corePVCSource(volume),
				Hotpluggable:                      true,
			},
		},
	}
}

func vmExists(ctx context.Context, c *Client, vm string) (bool, error) {
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
