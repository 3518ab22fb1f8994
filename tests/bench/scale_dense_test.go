package bench

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
)

// recordingController answers every publish and unpublish at once and
// remembers the VMs each volume was published to.
type recordingController struct {
	csi.ControllerClient
	mu        sync.Mutex
	published map[string][]string // volume -> VMs, in order
}

func (r *recordingController) ControllerPublishVolume(_ context.Context, req *csi.ControllerPublishVolumeRequest, _ ...grpc.CallOption) (*csi.ControllerPublishVolumeResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.published[req.VolumeId] = append(r.published[req.VolumeId], req.NodeId)
	return &csi.ControllerPublishVolumeResponse{}, nil
}

func (r *recordingController) ControllerUnpublishVolume(context.Context, *csi.ControllerUnpublishVolumeRequest, ...grpc.CallOption) (*csi.ControllerUnpublishVolumeResponse, error) {
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

type recordingHost struct{ c *recordingController }

func (h recordingHost) Controller() csi.ControllerClient            { return h.c }
func (recordingHost) Counts() (int, int, map[string]int)            { return 0, 0, map[string]int{} }
func (recordingHost) Reset()                                        {}
func (recordingHost) Sample(context.Context) (ProcessSample, error) { return ProcessSample{}, nil }

// TestRunScaleDense: with the dense shape, the first Dense volumes are
// attached to the last VM and every move of theirs goes back to it, no
// other volume is ever published there, and the dense VM's operations are
// reported on their own.
func TestRunScaleDense(t *testing.T) {
	rc := &recordingController{published: map[string][]string{}}
	h := recordingHost{c: rc}
	cfg := DefaultScale()
	cfg.VMs, cfg.Volumes, cfg.Dense, cfg.ChurnPerMinute, cfg.SameVM = 3, 24, 10, 0.5, 0
	cfg.Warmup, cfg.Duration, cfg.Scale, cfg.Workers = time.Minute, 3*time.Minute, 0.002, 8
	vms := []string{"vm-0", "vm-1", "vm-2", "dense"}
	var vols []string
	for i := range cfg.Volumes {
		vols = append(vols, "vol-"+string(rune('a'+i)))
	}
	res, err := RunScale(context.Background(), h, h, cfg, vms, vols, ScaleHooks{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Dense == nil || res.Dense.VM != "dense" || res.Dense.Volumes != 10 {
		t.Fatalf("dense figures %+v", res.Dense)
	}
	if res.Dense.Operations == 0 || res.Operations <= res.Dense.Operations {
		t.Errorf("%d operations, %d of them on the dense VM: want some on each", res.Operations, res.Dense.Operations)
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	for i, v := range vols {
		to := rc.published[v]
		if len(to) == 0 {
			t.Errorf("%s never published", v)
		}
		for _, vm := range to {
			if (i < cfg.Dense) != (vm == "dense") {
				t.Errorf("%s (dense %v) published to %s: %s", v, i < cfg.Dense, vm, strings.Join(to, ", "))
				break
			}
		}
	}
}

func TestSplitDenseRefuses(t *testing.T) {
	for _, c := range []struct {
		dense int
		vms   []string
	}{{-1, []string{"a", "b"}}, {5, []string{"a", "b"}}, {2, []string{"a"}}} {
		cfg := ScaleConfig{Dense: c.dense}
		if _, _, err := splitDense(cfg, c.vms, []string{"v1", "v2", "v3", "v4"}); err == nil {
			t.Errorf("dense %d over %d VMs: no error", c.dense, len(c.vms))
		}
	}
}
