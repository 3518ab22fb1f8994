package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/device"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/nodeid"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/sweeper"
)

// nodeFlags are the node service's settings.
type nodeFlags struct {
	sysfsRoot, byIDDir, kubeletRoot string
	sweepInterval                   time.Duration
	maxVolumes                      int64
}

func (n *nodeFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&n.sysfsRoot, "sysfs-root", device.DefaultSysfsRoot, "sysfs mount, for MAC addresses and block devices")
	fs.StringVar(&n.byIDDir, "by-id-dir", device.DefaultByIDDir, "where hot-plugged disks appear")
	fs.StringVar(&n.kubeletRoot, "kubelet-root-dir", sweeper.DefaultKubeletRoot, "kubelet's root directory; the stale staging sweeper touches nothing outside its plugins/kubernetes.io/csi")
	fs.DurationVar(&n.sweepInterval, "sweep-interval", time.Minute, "how often stale staging mounts are looked for (negative: never)")
	fs.Int64Var(&n.maxVolumes, "max-volumes-per-node", 0, "most volumes NodeGetInfo reports for this node, below the room KubeVirt's 256-disk limit leaves on its VM (0: that room)")
}

// service builds the node service. hostClient (nil when --nodeid is given in
// node mode) lets node ID discovery match MAC addresses against host VMIs.
func (n *nodeFlags) service(ctx context.Context, o *options, hostClient *host.Client) (*driver.NodeService, error) {
	if n.maxVolumes < 0 {
		return nil, fmt.Errorf("--max-volumes-per-node must not be negative, got %d", n.maxVolumes)
	}
	opts := driver.NodeOptions{
		NodeID:            o.nodeID,
		SysfsRoot:         n.sysfsRoot,
		ByIDDir:           n.byIDDir,
		KubeletRoot:       n.kubeletRoot,
		SweepInterval:     n.sweepInterval,
		Events:            guestEvents(ctx),
		MaxVolumesPerNode: n.maxVolumes,
	}
	if hostClient != nil {
		opts.VMIs = nodeid.KubeVirtSource(hostClient.KubeVirt.KubevirtV1().VirtualMachineInstances(hostClient.Namespace))
		opts.Exports = hostClient
	}
	return driver.NewNodeService(opts)
}

// guestEvents records the stale-mount sweeper's Events in the guest cluster
// when running in a pod there (NODE_NAME from the downward API); elsewhere
// the sweeper only logs.
func guestEvents(ctx context.Context) sweeper.EventRecorder {
	nodeName := os.Getenv("NODE_NAME")
	cfg, err := rest.InClusterConfig()
	if err != nil || nodeName == "" {
		klog.FromContext(ctx).Info("not in a guest pod with NODE_NAME: stale-mount events are logged only")
		return nil
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		klog.FromContext(ctx).Error(err, "guest client: stale-mount events are logged only")
		return nil
	}
	return sweeper.NewKubeEvents(ctx, client, nodeName, driver.Name)
}
