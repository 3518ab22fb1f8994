package simhost

import (
	"context"
	"errors"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Migrate live-migrates a guest VM to another host node, on either control
// plane, and returns the VirtualMachineInstanceMigration's name. On
// KubeVirt's real control plane it creates one through the API, as
// Harvester's migrate action does, and virt-controller's migration
// controller carries it out with the node agents playing virt-handler.
func (h *Host) Migrate(ctx context.Context, vm string) (string, error) {
	if h.Sim != nil {
		return h.Sim.Migrate(ctx, h.Namespace, vm, "")
	}
	if h.nodes == nil {
		// The kubelet stand-in binds pods by name: it would not keep the
		// target off the source node as KubeVirt's anti-affinity asks.
		return "", errors.New("simhost: a live migration on KubeVirt's real control plane needs HostStorage's host nodes")
	}
	mig := &kubevirtv1.VirtualMachineInstanceMigration{
		ObjectMeta: metav1.ObjectMeta{GenerateName: vm + "-migration-", Namespace: h.Namespace},
		Spec:       kubevirtv1.VirtualMachineInstanceMigrationSpec{VMIName: vm},
	}
	created, err := h.KubeVirt.KubevirtV1().VirtualMachineInstanceMigrations(h.Namespace).Create(ctx, mig, metav1.CreateOptions{})
	if err != nil {
		return "", err
	}
	return created.Name, nil
}

// Migration is a migration Migrate started, false when it is not found.
func (h *Host) Migration(ctx context.Context, name string) (*kubevirtv1.VirtualMachineInstanceMigration, bool) {
	if h.Sim != nil {
		return h.Sim.Migration(h.Namespace, name)
	}
	mig, err := h.KubeVirt.KubevirtV1().VirtualMachineInstanceMigrations(h.Namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, false
	}
	return mig, true
}

// HoldMigration keeps a VM's migrations transferring until released.
func (h *Host) HoldMigration(vm string, on bool) {
	if h.Sim != nil {
		h.Sim.Faults().HoldMigration(h.Namespace, vm, on)
		return
	}
	h.Real.HoldMigration(h.Namespace, vm, on)
}
