package main

import (
	"context"
	"errors"
	"flag"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

// nodeFlags are the node service's settings.
type nodeFlags struct{}

func (n *nodeFlags) register(fs *flag.FlagSet) {}

func (n *nodeFlags) service(ctx context.Context, o *options, hostClient *host.Client) (csi.NodeServer, error) {
	return nil, errors.New("the node service is not built into this version yet")
}
