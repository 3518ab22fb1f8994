package nodetap

import (
	"context"
	"net"
	"path/filepath"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// plugin is a node plugin that records the calls that reach it.
type plugin struct {
	csi.UnimplementedNodeServer
	mu    sync.Mutex
	calls []string
}

func (p *plugin) record(m, vol string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls = append(p.calls, m+" "+vol)
}

func (p *plugin) NodeStageVolume(_ context.Context, r *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	p.record("stage", r.VolumeId)
	if r.VolumeId == "bad" {
		return nil, status.Error(codes.FailedPrecondition, "no such disk")
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

func (p *plugin) NodeUnstageVolume(_ context.Context, r *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	p.record("unstage", r.VolumeId)
	return &csi.NodeUnstageVolumeResponse{}, nil
}

func start(t *testing.T, skip float64) (*plugin, csi.NodeClient, *[]Call) {
	t.Helper()
	dir := t.TempDir()
	p := &plugin{}
	ln, err := net.Listen("unix", filepath.Join(dir, "plugin.sock"))
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	csi.RegisterNodeServer(srv, p)
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	var mu sync.Mutex
	var calls []Call
	tap, err := Start(context.Background(), Options{Node: "node-0", Listen: filepath.Join(dir, "tap.sock"), Plugin: filepath.Join(dir, "plugin.sock"),
		SkipUnstage: skip, OnCall: func(c Call) { mu.Lock(); calls = append(calls, c); mu.Unlock() }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(tap.Stop)
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "tap.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return p, csi.NewNodeClient(conn), &calls
}

func TestTapPassesCallsAndErrorsThrough(t *testing.T) {
	p, c, calls := start(t, 0)
	ctx := context.Background()
	if _, err := c.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "pvc-1"}); err != nil {
		t.Fatal(err)
	}
	_, err := c.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "bad"})
	if status.Code(err) != codes.FailedPrecondition || status.Convert(err).Message() != "no such disk" {
		t.Fatalf("the plugin's error did not come through unchanged: %v", err)
	}
	if _, err := c.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "pvc-1"}); err != nil {
		t.Fatal(err)
	}
	if got := len(p.calls); got != 3 {
		t.Fatalf("plugin saw %v", p.calls)
	}
	if len(*calls) != 3 || (*calls)[0].Volume != "pvc-1" || (*calls)[1].Err == nil || (*calls)[2].Skipped {
		t.Fatalf("tap reported %+v", *calls)
	}
}

func TestTapCanSwallowNodeUnstage(t *testing.T) {
	p, c, calls := start(t, 1)
	if _, err := c.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "pvc-1"}); err != nil {
		t.Fatalf("the kubelet must see success: %v", err)
	}
	if len(p.calls) != 0 {
		t.Fatalf("NodeUnstageVolume reached the plugin: %v", p.calls)
	}
	if len(*calls) != 1 || !(*calls)[0].Skipped || (*calls)[0].Volume != "pvc-1" {
		t.Fatalf("tap reported %+v", *calls)
	}
}
