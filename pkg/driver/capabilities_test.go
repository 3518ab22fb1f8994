package driver

import (
	"context"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// ReadWriteOncePod reaches a driver as SINGLE_NODE_SINGLE_WRITER only when
// both the controller and the node plugin offer SINGLE_NODE_MULTI_WRITER
// (CSI spec v1.5.0): the sidecars read the controller's, kubelet the
// node's. Without them both modes arrive as SINGLE_NODE_WRITER and the
// driver cannot tell a ReadWriteOncePod claim from a ReadWriteOnce one.
func TestSingleNodeAccessModesAdvertised(t *testing.T) {
	ctx := context.Background()
	s, _, _ := newTestController(ControllerOptions{})
	cresp, err := s.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var ctrl []csi.ControllerServiceCapability_RPC_Type
	for _, c := range cresp.GetCapabilities() {
		ctrl = append(ctrl, c.GetRpc().GetType())
	}
	if !slices.Contains(ctrl, csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER) {
		t.Errorf("controller capabilities %v lack SINGLE_NODE_MULTI_WRITER", ctrl)
	}
	nresp, err := (&NodeService{}).NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var node []csi.NodeServiceCapability_RPC_Type
	for _, c := range nresp.GetCapabilities() {
		node = append(node, c.GetRpc().GetType())
	}
	if !slices.Contains(node, csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER) {
		t.Errorf("node capabilities %v lack SINGLE_NODE_MULTI_WRITER", node)
	}
	// Every single-node mode, the old one included (the spec's MUST for
	// older COs), is a capability the driver serves.
	for _, mode := range []csi.VolumeCapability_AccessMode_Mode{
		csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER,
	} {
		for _, block := range []bool{false, true} {
			if err := checkCapability(capability(mode, block)); err != nil {
				t.Errorf("%s (block %v) refused: %v", mode, block, err)
			}
		}
	}
}
