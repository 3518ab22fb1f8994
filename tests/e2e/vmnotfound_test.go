package e2e

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestPublishToADeletedVMNamesWhatIsMissing: a publish to a guest node whose
// VM was deleted answers NotFound, and the message (all the external-attacher
// shows on the VolumeAttachment) names the VM, the volume and the host
// namespace it looked in.
func TestPublishToADeletedVMNamesWhatIsMissing(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_7_0, Scale: 0.05, BindClasslessPVCs: true})
	h.CreateVMs(t, "nf-gone")
	vol := h.CreateVolumes(t, "nf", 1)[0]
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: "auto", Queue: hotplug.Config{BatchWindow: 50 * time.Millisecond, MaxHold: 1500 * time.Millisecond}})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := h.Sim.DeleteVM(ctx, h.Namespace, "nf-gone"); err != nil {
		t.Fatal(err)
	}
	if err := h.Sim.Wait(ctx, h.Namespace, "nf-gone", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool { return vm == nil }); err != nil {
		t.Fatal(err)
	}
	_, err := ctrl.Client.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: "nf-gone",
		VolumeCapability: &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("publish to a deleted VM: %v, want NotFound", err)
	}
	want := "VM nf-gone of volume " + vol + " not found in host namespace " + h.Namespace
	if msg := status.Convert(err).Message(); !strings.Contains(msg, want) {
		t.Errorf("message %q does not say %q", msg, want)
	}
	// The queue's own answer keeps matching the sentinel callers test for.
	if err := ctrl.Queue.Attach(ctx, "nf-gone", vol, true); !errors.Is(err, hotplug.ErrVMNotFound) {
		t.Errorf("queue answer %v does not match hotplug.ErrVMNotFound", err)
	}
}
