// Command csi-registrar registers a CSI node plugin with one kubelet through
// the kubelet's plugin registry, as node-driver-registrar does (that module is
// not available to build here): it asks the plugin for its name
// (Identity.GetPluginInfo), serves the registration service on
// <registration-dir>/<name>-reg.sock, answers the kubelet's GetInfo with the
// endpoint the kubelet must use, and exits when the kubelet reports a failed
// registration. The kubelet's plugin watcher, the CSI plugin's registration
// handler (NodeGetInfo, CSINode, the node annotation) are the real ones.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

func main() {
	var csiAddress, kubeletPath, regDir string
	fs := flag.NewFlagSet("csi-registrar", flag.ExitOnError)
	fs.StringVar(&csiAddress, "csi-address", "", "the plugin's socket, as this process reaches it")
	fs.StringVar(&kubeletPath, "kubelet-registration-path", "", "the plugin's socket, as the kubelet reaches it")
	fs.StringVar(&regDir, "plugin-registration-dir", "", "the kubelet's plugins_registry directory")
	klog.InitFlags(fs)
	_ = fs.Parse(os.Args[1:])
	if csiAddress == "" || kubeletPath == "" || regDir == "" {
		fmt.Fprintln(os.Stderr, "csi-registrar: --csi-address, --kubelet-registration-path and --plugin-registration-dir are required")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := run(ctx, csiAddress, kubeletPath, regDir); err != nil {
		klog.ErrorS(err, "csi-registrar failed")
		klog.Flush()
		os.Exit(1)
	}
}

func run(ctx context.Context, csiAddress, kubeletPath, regDir string) error {
	name, err := pluginName(ctx, csiAddress)
	if err != nil {
		return err
	}
	sock := filepath.Join(regDir, name+"-reg.sock")
	_ = os.Remove(sock)
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return err
	}
	defer os.Remove(sock)
	failed := make(chan error, 1)
	srv := grpc.NewServer()
	registerapi.RegisterRegistrationServer(srv, &registrar{name: name, endpoint: kubeletPath, failed: failed})
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()
	klog.InfoS("registration socket serving", "driver", name, "socket", sock, "endpoint", kubeletPath)
	select {
	case <-ctx.Done():
		return nil
	case err := <-failed:
		return err
	}
}

// pluginName asks the plugin for its name, waiting for its socket to appear.
func pluginName(ctx context.Context, address string) (string, error) {
	target := "unix://" + strings.TrimPrefix(address, "unix://")
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return "", err
	}
	defer conn.Close()
	id := csi.NewIdentityClient(conn)
	for {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		resp, err := id.GetPluginInfo(cctx, &csi.GetPluginInfoRequest{})
		cancel()
		if err == nil && resp.GetName() != "" {
			return resp.GetName(), nil
		}
		klog.InfoS("waiting for the CSI plugin", "address", address, "err", err)
		select {
		case <-ctx.Done():
			return "", errors.Join(ctx.Err(), err)
		case <-time.After(time.Second):
		}
	}
}

type registrar struct {
	registerapi.UnimplementedRegistrationServer
	name, endpoint string
	failed         chan error
}

func (r *registrar) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              r.name,
		Endpoint:          r.endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

func (r *registrar) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if !st.PluginRegistered {
		klog.ErrorS(nil, "kubelet refused the registration", "driver", r.name, "error", st.Error)
		select {
		case r.failed <- fmt.Errorf("registration failed: %s", st.Error):
		default:
		}
		return &registerapi.RegistrationStatusResponse{}, nil
	}
	klog.InfoS("registered with the kubelet", "driver", r.name)
	return &registerapi.RegistrationStatusResponse{}, nil
}
