package node

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
)

// The node never touches another volume's disk or anything outside its own
// paths.

// blank reports whether blkid finds nothing at all on dev.
func blank(t *testing.T, dev string) bool {
	t.Helper()
	err := exec.Command("blkid", "-p", "--", dev).Run()
	if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() == 2 {
		return true
	}
	if err != nil {
		t.Fatalf("blkid %s: %v", dev, err)
	}
	return false
}

// With only pvc-node1 (and 00000) plugged, staging pvc-node (or 0000)
// finds nothing, and the other volume's blank disk is neither mounted nor
// formatted.
func TestStageNeverTakesAnotherVolumesDisk(t *testing.T) {
	h := newHarness(t, 64*mib)
	ctx := testContext(t)
	c := mountCap("ext4", rwo)
	a := h.node("vm-a", nil)
	for plugged, asked := range map[string]string{"pvc-node1": "pvc-node", "00000": "0000"} {
		dev := h.plug("vm-a", plugged)
		staging, _ := a.paths(asked, "pod")
		err := a.stage(ctx, asked, staging, c)
		wantCode(t, err, codes.Unavailable, "stage "+asked+" with only "+plugged+" plugged")
		if isMountPoint(t, staging) {
			t.Fatalf("staging %s mounted %s's disk", asked, plugged)
		}
		if !blank(t, dev) {
			t.Fatalf("%s's disk was formatted for %s", plugged, asked)
		}
		// The exact volume still stages.
		ownStaging, _ := a.paths(plugged, "pod")
		must(t, a.stage(ctx, plugged, ownStaging, c), "stage "+plugged)
		must(t, a.unstage(ctx, plugged, ownStaging), "unstage "+plugged)
	}
}

// Paths reach mount(8) only as absolute, clean operands. A staging
// path "--version" used to make mount print its version and the call answer
// OK with nothing mounted.
func TestPathsMustBeAbsoluteAndClean(t *testing.T) {
	h := newHarness(t, 64*mib)
	// Whatever a relative path does, it does it here, where the harness
	// cleans up.
	cwd := filepath.Join(h.root, "cwd")
	must(t, os.MkdirAll(cwd, 0o750), "mkdir")
	t.Chdir(cwd)
	ctx := testContext(t)
	c := mountCap("ext4", rwo)
	a := h.node("vm-a", nil)
	vol := "pvc-paths"
	dev := h.plug("vm-a", vol)
	staging, target := a.paths(vol, "pod")
	for _, bad := range []string{"--version", "-o", "staging", staging + "/", staging + "/../globalmount", filepath.Dir(staging) + "//globalmount"} {
		wantCode(t, a.stage(ctx, vol, bad, c), codes.InvalidArgument, "stage at "+bad)
		wantCode(t, a.unstage(ctx, vol, bad), codes.InvalidArgument, "unstage at "+bad)
		wantCode(t, a.publish(ctx, vol, bad, target, c, false), codes.InvalidArgument, "publish from staging "+bad)
		wantCode(t, a.publish(ctx, vol, staging, bad, c, false), codes.InvalidArgument, "publish to "+bad)
		wantCode(t, a.unpublish(ctx, vol, bad), codes.InvalidArgument, "unpublish "+bad)
	}
	if !blank(t, dev) {
		t.Fatal("a refused call formatted the disk")
	}
	if entries, _ := os.ReadDir("."); len(entries) > 0 {
		t.Fatalf("a refused call created %v in the working directory", entries)
	}
}

// NodePublish onto a target that is a symlink to a directory (or, for
// a block volume, a file) outside kubelet's directory is refused, and the
// link's destination is not mounted over.
func TestPublishNeverFollowsATargetSymlink(t *testing.T) {
	h := newHarness(t, 64*mib)
	ctx := testContext(t)
	a := h.node("vm-a", nil)
	outside := filepath.Join(h.root, "outside")
	must(t, os.MkdirAll(outside, 0o750), "mkdir")
	must(t, os.WriteFile(filepath.Join(outside, "file"), []byte("keep"), 0o600), "write")

	for _, tc := range []struct {
		name, dest string
		c          *csi.VolumeCapability
	}{
		{"filesystem", outside, mountCap("ext4", rwo)},
		{"block", filepath.Join(outside, "file"), blockCap()},
	} {
		vol := "pvc-link-" + tc.name
		h.plug("vm-a", vol)
		staging, target := a.paths(vol, "pod")
		must(t, a.stage(ctx, vol, staging, tc.c), "stage")
		must(t, os.Symlink(tc.dest, target), "plant the symlink")
		err := a.publish(ctx, vol, staging, target, tc.c, false)
		if err == nil {
			t.Fatalf("%s: publish onto a symlink succeeded", tc.name)
		}
		wantCode(t, err, codes.FailedPrecondition, tc.name+" publish onto a symlink")
		if isMountPoint(t, tc.dest) {
			t.Fatalf("%s: publish mounted over the symlink's destination %s", tc.name, tc.dest)
		}
		if b, err := os.ReadFile(filepath.Join(outside, "file")); err != nil || string(b) != "keep" {
			t.Fatalf("%s: the destination changed: %q %v", tc.name, b, err)
		}
		// Tearing the link down is harmless: the link goes, its destination
		// stays.
		must(t, a.unpublish(ctx, vol, target), "unpublish the symlink")
		if exists(target) || !exists(tc.dest) {
			t.Fatalf("%s: unpublish left the link (%v) or removed its destination (%v)", tc.name, exists(target), !exists(tc.dest))
		}
		must(t, a.unstage(ctx, vol, staging), "unstage")
	}
}

// NodeUnpublish (and NodeUnstage) of a path that is a symlink to an
// unrelated mount leaves that mount alone.
func TestTeardownOfASymlinkLeavesTheUnrelatedMount(t *testing.T) {
	h := newHarness(t, 64*mib)
	ctx := testContext(t)
	a := h.node("vm-a", nil)
	unrelated := filepath.Join(h.root, "unrelated")
	nodetest.Run(t, "mkdir", "-p", unrelated)
	nodetest.Run(t, "mount", "-t", "tmpfs", "tmpfs", unrelated)
	staging, target := a.paths("pvc-x", "pod")
	must(t, os.Symlink(unrelated, target), "plant the target symlink")
	must(t, os.Remove(staging), "remove staging dir")
	must(t, os.Symlink(unrelated, staging), "plant the staging symlink")

	if err := a.unpublish(ctx, "pvc-x", target); err != nil && status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("unpublish of a symlink: %v", err)
	}
	if err := a.unstage(ctx, "pvc-x", staging); err != nil && status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("unstage of a symlink: %v", err)
	}
	if !isMountPoint(t, unrelated) {
		t.Fatal("tearing down a symlink unmounted the unrelated mount it points at")
	}
	// Staging onto the link is refused as well.
	h.plug("vm-a", "pvc-x")
	wantCode(t, a.stage(ctx, "pvc-x", staging, mountCap("ext4", rwo)), codes.FailedPrecondition, "stage onto a symlink")
	if got := strings.TrimSpace(nodetest.Run(t, "findmnt", "-n", "-o", "FSTYPE", unrelated)); got != "tmpfs" {
		t.Fatalf("the unrelated mount now has %q on top", got)
	}
}

// The sweeper only touches block-device mounts at this driver's
// staging paths under the kubelet root. A tmpfs with a forged vol_data.json
// inside it, and a stale disk mount with a genuine-looking vol_data.json
// outside it, are left alone while a real stale staging mount is swept.
func TestSweeperStaysInsideItsScope(t *testing.T) {
	h := newHarness(t, 64*mib)
	ctx := testContext(t)
	a := h.node("vm-a", nil)
	c := mountCap("ext4", rwo)
	volData := func(dir, vol string) {
		must(t, os.MkdirAll(dir, 0o750), "mkdir")
		vd := `{"driverName":"` + driver.Name + `","volumeHandle":"` + vol + `"}`
		must(t, os.WriteFile(filepath.Join(dir, "vol_data.json"), []byte(vd), 0o600), "write vol_data.json")
	}

	forged := filepath.Join(h.kubeletRoot("vm-a"), "plugins/kubernetes.io/csi", driver.Name, "forged")
	volData(forged, "pvc-forged")
	forgedMount := filepath.Join(forged, "globalmount")
	nodetest.Run(t, "mkdir", "-p", forgedMount)
	nodetest.Run(t, "mount", "-t", "tmpfs", "tmpfs", forgedMount)

	outside := filepath.Join(h.root, "elsewhere/plugins/kubernetes.io/csi", driver.Name, "pvc-outside")
	volData(outside, "pvc-outside")
	outsideMount := filepath.Join(outside, "globalmount")
	dev := h.plug("vm-a", "pvc-outside")
	nodetest.Run(t, "mkfs.ext4", "-q", dev)
	nodetest.Run(t, "mkdir", "-p", outsideMount)
	nodetest.Run(t, "mount", dev, outsideMount)
	h.unplug("vm-a", "pvc-outside")

	// The genuine stale mount sorts after the others, and a sweep handles
	// its candidates in path order: once it is gone, the others were looked
	// at in the same pass.
	vol := "pvc-zzz"
	h.plug("vm-a", vol)
	staging, _ := a.paths(vol, "pod")
	must(t, a.stage(ctx, vol, staging, c), "stage")
	h.unplug("vm-a", vol)
	runSweeper(t, a)
	nodetest.Eventually(t, "the real stale staging mount to be swept", func() bool { return !isMountPoint(t, staging) })
	for _, p := range []string{forgedMount, outsideMount} {
		if !isMountPoint(t, p) {
			t.Errorf("the sweeper unmounted %s", p)
		}
	}
	for _, ev := range a.events.list() {
		if !strings.HasPrefix(ev, vol+"|") {
			t.Errorf("event about something else: %s", ev)
		}
	}
	nodetest.Run(t, "umount", forgedMount)
	nodetest.Run(t, "umount", outsideMount)
	h.waitNoLoops(vol)
	h.waitNoLoops("pvc-outside")
}

// Stats (and expansion) answer only for a mount of the volume's own
// disk; "/" or another volume's mount is NotFound.
func TestStatsAndExpandOnlyForTheVolumesOwnMount(t *testing.T) {
	h := newHarness(t, 64*mib)
	ctx := testContext(t)
	a := h.node("vm-a", nil)
	c := mountCap("ext4", rwo)
	h.plug("vm-a", "pvc-a")
	h.plug("vm-a", "pvc-b")
	stagingA, targetA := a.paths("pvc-a", "pod")
	stagingB, _ := a.paths("pvc-b", "pod")
	must(t, a.stage(ctx, "pvc-a", stagingA, c), "stage a")
	must(t, a.publish(ctx, "pvc-a", stagingA, targetA, c, false), "publish a")
	must(t, a.stage(ctx, "pvc-b", stagingB, c), "stage b")

	for _, p := range []string{"/", stagingB, h.root} {
		_, err := a.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "pvc-a", VolumePath: p})
		wantCode(t, err, codes.NotFound, "stats of pvc-a at "+p)
	}
	_, err := a.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: "pvc-a", VolumePath: stagingB})
	wantCode(t, err, codes.NotFound, "expand pvc-a at pvc-b's mount")
	for _, p := range []string{stagingA, targetA} {
		_, err := a.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "pvc-a", VolumePath: p})
		must(t, err, "stats of pvc-a at its own "+p)
	}
	must(t, a.unpublish(ctx, "pvc-a", targetA), "unpublish a")
	must(t, a.unstage(ctx, "pvc-a", stagingA), "unstage a")
	must(t, a.unstage(ctx, "pvc-b", stagingB), "unstage b")
}
