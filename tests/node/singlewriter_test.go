package node

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// A ReadWriteOncePod volume (SINGLE_NODE_SINGLE_WRITER) is published at one
// target on a node; a second target is FAILED_PRECONDITION, as the CSI
// spec's table for plugins with the SINGLE_NODE_MULTI_WRITER capability
// says. A ReadWriteOnce volume (SINGLE_NODE_MULTI_WRITER) serves several
// pods of the node. After the first target is unpublished the volume can go
// to the next pod.
func TestSingleWriterPublishedOnce(t *testing.T) {
	for _, tc := range []struct {
		name       string
		block      bool
		mode       csi.VolumeCapability_AccessMode_Mode
		secondCode codes.Code
	}{
		{"ReadWriteOncePod filesystem", false, csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER, codes.FailedPrecondition},
		{"ReadWriteOncePod block", true, csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER, codes.FailedPrecondition},
		{"ReadWriteOnce filesystem", false, csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER, codes.OK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, 64*mib)
			ctx := testContext(t)
			vol := "pvc-once"
			c := mountCap("ext4", tc.mode)
			if tc.block {
				c = blockCap()
				c.AccessMode.Mode = tc.mode
			}
			a := h.node("vm-a", nil)
			h.plug("vm-a", vol)
			staging, first := a.paths(vol, "pod-1")
			_, second := a.paths(vol, "pod-2")
			must(t, a.stage(ctx, vol, staging, c), "stage")
			must(t, a.publish(ctx, vol, staging, first, c, false), "publish to the first pod")
			must(t, a.publish(ctx, vol, staging, first, c, false), "the same publish again")
			err := a.publish(ctx, vol, staging, second, c, false)
			if tc.secondCode == codes.OK {
				must(t, err, "publish to a second pod")
				must(t, a.unpublish(ctx, vol, second), "unpublish the second pod")
			} else {
				wantCode(t, err, tc.secondCode, "publish to a second pod")
				if isMountPoint(t, second) {
					t.Fatal("the second target was mounted")
				}
			}
			must(t, a.unpublish(ctx, vol, first), "unpublish the first pod")
			must(t, a.publish(ctx, vol, staging, second, c, false), "publish to the next pod once the first let go")
			must(t, a.unpublish(ctx, vol, second), "unpublish the next pod")
			must(t, a.unstage(ctx, vol, staging), "unstage")
		})
	}
}
