// Package nodetap sits between a kubelet and a driver's node plugin: it
// serves a CSI socket the kubelet registers, passes every call on to the
// plugin's socket unchanged, tells the lab about each node call, and can
// answer NodeUnstageVolume with success without passing it on (the
// kubelet's device unmount that never reaches the driver).
package nodetap

import (
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"k8s.io/klog/v2"
)

const methodUnstage = "/csi.v1.Node/NodeUnstageVolume"

// Call is one node call seen by the tap.
type Call struct {
	Node, Method, Volume string
	Start, End           time.Time
	Err                  error
	// Skipped: NodeUnstageVolume answered by the tap, never sent.
	Skipped bool
}

// Options configure a Tap.
type Options struct {
	Node string
	// Listen is the socket the kubelet uses; Plugin the driver's.
	Listen, Plugin string
	// SkipUnstage is the probability of answering NodeUnstageVolume without
	// passing it on.
	SkipUnstage float64
	// Seed seeds the skip decisions.
	Seed uint64
	// OnCall, if set, is told about every call when it ends.
	OnCall func(Call)
}

// Tap is a running tap.
type Tap struct {
	o    Options
	srv  *grpc.Server
	conn *grpc.ClientConn

	mu  sync.Mutex
	rnd *rand.Rand
}

// Start serves o.Listen.
func Start(ctx context.Context, o Options) (*Tap, error) {
	conn, err := grpc.NewClient("unix://"+o.Plugin, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	_ = os.Remove(o.Listen)
	ln, err := net.Listen("unix", o.Listen)
	if err != nil {
		conn.Close()
		return nil, err
	}
	t := &Tap{o: o, conn: conn, rnd: rand.New(rand.NewPCG(o.Seed, o.Seed^0x5bd1e995))}
	t.srv = grpc.NewServer(grpc.ForceServerCodec(rawCodec{}), grpc.UnknownServiceHandler(t.forward))
	logger := klog.FromContext(ctx).WithValues("node", o.Node)
	go func() {
		if err := t.srv.Serve(ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			logger.Error(err, "node tap stopped serving")
		}
	}()
	return t, nil
}

// Stop stops serving.
func (t *Tap) Stop() {
	t.srv.Stop()
	t.conn.Close()
}

func (t *Tap) skip() bool {
	if t.o.SkipUnstage <= 0 {
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.rnd.Float64() < t.o.SkipUnstage
}

func (t *Tap) forward(_ any, stream grpc.ServerStream) error {
	method, _ := grpc.MethodFromServerStream(stream)
	var req []byte
	if err := stream.RecvMsg(&req); err != nil {
		return err
	}
	c := Call{Node: t.o.Node, Method: method, Volume: volumeOf(method, req), Start: time.Now()}
	defer func() {
		if t.o.OnCall != nil && strings.HasPrefix(method, "/csi.v1.Node/Node") && !strings.HasSuffix(method, "GetInfo") && !strings.HasSuffix(method, "GetCapabilities") {
			c.End = time.Now()
			t.o.OnCall(c)
		}
	}()
	if method == methodUnstage && t.skip() {
		c.Skipped = true
		empty := []byte{}
		return stream.SendMsg(&empty)
	}
	var resp []byte
	if err := t.conn.Invoke(stream.Context(), method, &req, &resp, grpc.ForceCodec(rawCodec{})); err != nil {
		c.Err = err
		if _, ok := status.FromError(err); ok {
			return err
		}
		return status.Error(status.Code(err), err.Error())
	}
	return stream.SendMsg(&resp)
}

// volumeOf reads the volume ID of a node call (field 1 of every request that
// has one).
func volumeOf(method string, req []byte) string {
	var m interface {
		proto.Message
		GetVolumeId() string
	}
	switch method {
	case "/csi.v1.Node/NodeStageVolume":
		m = &csi.NodeStageVolumeRequest{}
	case methodUnstage:
		m = &csi.NodeUnstageVolumeRequest{}
	case "/csi.v1.Node/NodePublishVolume":
		m = &csi.NodePublishVolumeRequest{}
	case "/csi.v1.Node/NodeUnpublishVolume":
		m = &csi.NodeUnpublishVolumeRequest{}
	case "/csi.v1.Node/NodeGetVolumeStats":
		m = &csi.NodeGetVolumeStatsRequest{}
	case "/csi.v1.Node/NodeExpandVolume":
		m = &csi.NodeExpandVolumeRequest{}
	default:
		return ""
	}
	if proto.Unmarshal(req, m) != nil {
		return ""
	}
	return m.GetVolumeId()
}

// rawCodec passes messages through as bytes.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) {
	b, ok := v.(*[]byte)
	if !ok {
		return nil, errors.New("nodetap: not raw bytes")
	}
	return *b, nil
}

func (rawCodec) Unmarshal(data []byte, v any) error {
	b, ok := v.(*[]byte)
	if !ok {
		return errors.New("nodetap: not raw bytes")
	}
	*b = append((*b)[:0], data...)
	return nil
}

func (rawCodec) Name() string { return "proto" }
