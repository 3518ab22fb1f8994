package node

import (
	"context"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/sweeper"
)

// runSweeper runs the node's background sweeper for the rest of the test.
func runSweeper(t *testing.T, n *node) {
	ctx, cancel := context.WithCancel(testContext(t))
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		n.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
}

// Kubelet never calls NodeUnstage (a kubelet race) and the disk is unplugged
// under the staging mount. The sweeper removes the stale mount and reports
// it, the disk is then really released, a mount whose disk is still there is
// left alone, and staging the volume again on the same node works.
func TestSweeperCleansUpMissingUnstage(t *testing.T) {
	h := newHarness(t, 64*mib)
	ctx := testContext(t)
	c := mountCap("ext4", rwo)
	a := h.node("vm-a", nil)

	vol, other := "pvc-forgotten", "pvc-present"
	h.plug("vm-a", vol)
	h.plug("vm-a", other)
	staging, target := a.paths(vol, "pod")
	otherStaging, _ := a.paths(other, "pod")
	must(t, a.stage(ctx, vol, staging, c), "stage")
	must(t, a.stage(ctx, other, otherStaging, c), "stage other")
	must(t, a.publish(ctx, vol, staging, target, c, false), "publish")
	nodetest.WriteRandom(t, filepath.Join(target, "data"), 2<<20, 5)
	sum := nodetest.Checksum(t, filepath.Join(target, "data"))
	must(t, a.unpublish(ctx, vol, target), "unpublish")

	// No NodeUnstage: the volume is detached while still staged.
	h.unplug("vm-a", vol)
	if len(h.loopsOf(vol)) == 0 {
		t.Fatal("the staged disk should stay busy after the unplug, as on a real VM")
	}
	st, err := a.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: vol, VolumePath: staging})
	must(t, err, "stats of the stale staging mount")
	if !st.GetVolumeCondition().GetAbnormal() {
		t.Fatalf("condition of a staging mount without disk should be abnormal: %v", st.GetVolumeCondition())
	}

	runSweeper(t, a)
	nodetest.Eventually(t, "the sweeper to unmount the stale staging path", func() bool { return !isMountPoint(t, staging) })
	h.waitNoLoops(vol) // the disk is really released now
	nodetest.Eventually(t, "the event", func() bool { return len(a.events.list()) > 0 })
	ev := a.events.list()[0]
	for _, want := range []string{vol, sweeper.EventTypeWarning, sweeper.ReasonStaleStagingRemoved, staging} {
		if !strings.Contains(ev, want) {
			t.Fatalf("event %q lacks %q", ev, want)
		}
	}
	if !isMountPoint(t, otherStaging) {
		t.Fatal("the sweeper unmounted a volume whose disk is present")
	}

	h.plug("vm-a", vol)
	must(t, a.stage(ctx, vol, staging, c), "stage again on the same node")
	must(t, a.publish(ctx, vol, staging, target, c, false), "publish again")
	if got := nodetest.Checksum(t, filepath.Join(target, "data")); got != sum {
		t.Fatal("data changed")
	}
	must(t, a.unpublish(ctx, vol, target), "unpublish")
	must(t, a.unstage(ctx, vol, staging), "unstage")
	must(t, a.unstage(ctx, other, otherStaging), "unstage other")
	if n := len(a.events.list()); n != 1 {
		t.Fatalf("want exactly one event, got %d: %v", n, a.events.list())
	}
}

// The volume comes back before the sweeper ran: NodeStage itself replaces
// the stale staging mount.
func TestStageReplacesStaleStagingMount(t *testing.T) {
	h := newHarness(t, 64*mib)
	ctx := testContext(t)
	c := mountCap("ext4", rwo)
	a := h.node("vm-a", func(o *driver.NodeOptions) { o.SweepInterval = -1 })
	vol := "pvc-back"
	h.plug("vm-a", vol)
	staging, target := a.paths(vol, "pod")
	must(t, a.stage(ctx, vol, staging, c), "stage")
	must(t, a.publish(ctx, vol, staging, target, c, false), "publish")
	nodetest.WriteRandom(t, filepath.Join(target, "data"), 1<<20, 2)
	sum := nodetest.Checksum(t, filepath.Join(target, "data"))
	must(t, a.unpublish(ctx, vol, target), "unpublish")
	h.unplug("vm-a", vol)
	h.plug("vm-a", vol) // a new loop device; the old one is still busy

	must(t, a.stage(ctx, vol, staging, c), "stage over the stale mount")
	h.waitNoLoopsBut(vol, 1)
	must(t, a.publish(ctx, vol, staging, target, c, false), "publish")
	if got := nodetest.Checksum(t, filepath.Join(target, "data")); got != sum {
		t.Fatal("data changed")
	}
	if len(a.events.list()) != 1 {
		t.Fatalf("want one event about the stale mount, got %v", a.events.list())
	}
	must(t, a.unpublish(ctx, vol, target), "unpublish")
	must(t, a.unstage(ctx, vol, staging), "unstage")
}

// A node upgraded from upstream has volumes mounted straight onto their
// target path with nothing on the staging path. They must unpublish and
// unstage, and a second pod on the node must still be able to publish.
func TestUpstreamMountedVolume(t *testing.T) {
	h := newHarness(t, 64*mib)
	ctx := testContext(t)
	c := mountCap("ext4", rwo)
	vol := "pvc-upstream"
	dev := h.plug("vm-a", vol)
	a := h.node("vm-a", nil)
	staging, oldTarget := a.paths(vol, "old-pod")
	_, newTarget := a.paths(vol, "new-pod")

	// What upstream's NodePublish did: format and mount the disk on the target.
	nodetest.Run(t, "mkfs.ext4", "-q", dev)
	nodetest.Run(t, "mkdir", "-p", oldTarget)
	nodetest.Run(t, "mount", "-t", "ext4", dev, oldTarget)
	nodetest.WriteRandom(t, filepath.Join(oldTarget, "data"), 1<<20, 4)
	sum := nodetest.Checksum(t, filepath.Join(oldTarget, "data"))

	// Kubelet considers the volume staged and publishes it for another pod.
	must(t, a.publish(ctx, vol, staging, newTarget, c, false), "publish for a new pod after the upgrade")
	if got := nodetest.Checksum(t, filepath.Join(newTarget, "data")); got != sum {
		t.Fatal("new pod sees different data")
	}
	must(t, a.unpublish(ctx, vol, oldTarget), "unpublish the upstream mount")
	if exists(oldTarget) {
		t.Fatal("old target not removed")
	}
	must(t, a.unpublish(ctx, vol, newTarget), "unpublish the new pod")
	must(t, a.unstage(ctx, vol, staging), "unstage")
	if isMountPoint(t, staging) {
		t.Fatal("staging still mounted")
	}

	// And the simpler case: only the upstream mount, then teardown.
	nodetest.Run(t, "mkdir", "-p", oldTarget)
	nodetest.Run(t, "mount", "-t", "ext4", dev, oldTarget)
	must(t, a.unpublish(ctx, vol, oldTarget), "unpublish the upstream mount")
	must(t, a.unstage(ctx, vol, staging), "unstage a never-staged volume")
	h.unplug("vm-a", vol)
	h.waitNoLoops(vol)
}
