// CoreDNS with only the plugins the local cluster's DNS needs (Service and Pod names from the API server,
// everything else forwarded to the host's resolver): the upstream binary's cloud plugins (route53, azure,
// clouddns, ...) would triple the build time. This is CoreDNS' documented way to pick plugins in Go
// (coremain.Run with dnsserver.Directives); the order is upstream's plugin.cfg order.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	dnsserver.Directives = []string{"bind", "ready", "health", "errors", "log", "cache", "kubernetes", "forward"}
}

func main() {
	coremain.Run()
}
